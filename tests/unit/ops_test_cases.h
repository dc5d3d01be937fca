// The op-case table of ops_backend_test.cpp (in the spirit of ggml's tests/test-backend-ops.cpp): for every op in
// src/moecore/ops/*.h, how to build random inputs, run the forward op and (when the op has one) its backward op,
// which tensors each writes, and which bad arguments must be refused. Tensors live in an Env by name, so the
// harness can re-run, perturb, snapshot and corrupt them without knowing the op.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "moecore/ops/ops.h"
#include "moecore/tensor/rng.h"

namespace moecore::ops::test {

// ---- element access in any floating type -----------------------------------------------------------------------

// bf16 / fp16 elements are decoded exactly; set() rounds to them as dtype.h does.
inline double get(const Tensor& t, const int64_t i) {
  switch (t.dtype()) {
    case DType::kF64: return t.data<double>()[i];
    case DType::kBF16: return bf16_to_fp32(t.data<uint16_t>()[i]);
    case DType::kF16: return fp16_to_fp32(t.data<uint16_t>()[i]);
    case DType::kI32: return t.data<int32_t>()[i];
    case DType::kI64: return static_cast<double>(t.data<int64_t>()[i]);
    case DType::kU8: return t.data<uint8_t>()[i];
    default: return static_cast<double>(t.data<float>()[i]);
  }
}
inline void set(Tensor& t, const int64_t i, const double value) {
  switch (t.dtype()) {
    case DType::kF64: t.data<double>()[i] = value; return;
    case DType::kBF16: t.data<uint16_t>()[i] = fp32_to_bf16(static_cast<float>(value)); return;
    case DType::kF16: t.data<uint16_t>()[i] = fp32_to_fp16(static_cast<float>(value)); return;
    default: t.data<float>()[i] = static_cast<float>(value); return;
  }
}
inline std::vector<double> values(const Tensor& t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) out[static_cast<size_t>(i)] = get(t, i);
  return out;
}

// max |got - want| <= tol * (1 + max |want|): relative to the tensor's magnitude, so a different summation order
// on a fast path passes and a wrong formula does not. NaN in one and not the other fails; an infinity (attention's
// lse of a row that sees no key) must be matched exactly and does not count in max |want|.
inline ::testing::AssertionResult close(const std::vector<double>& got, const std::vector<double>& want,
                                        const double tol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " elements, expected " << want.size();
  }
  double max_diff = 0.0, max_want = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(want[i])) {
      return ::testing::AssertionFailure() << "element " << i << " is " << got[i] << ", expected " << want[i];
    }
    if (std::isnan(got[i])) continue;
    if (std::isinf(got[i]) || std::isinf(want[i])) {
      if (got[i] == want[i]) continue;
      return ::testing::AssertionFailure() << "element " << i << " is " << got[i] << ", expected " << want[i];
    }
    max_want = std::max(max_want, std::abs(want[i]));
    const double diff = std::abs(got[i] - want[i]);
    if (diff > max_diff) {
      max_diff = diff;
      worst = i;
    }
  }
  if (max_diff <= tol * (1.0 + max_want)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max |diff| " << max_diff << " at element " << worst << " (got " << got[worst]
                                       << ", expected " << want[worst] << "), max |expected| " << max_want
                                       << ", tolerance " << tol << " * (1 + max |expected|)";
}
inline ::testing::AssertionResult close(const Tensor& got, const Tensor& want, const double tol) {
  return close(values(got), values(want), tol);
}

// ---- named tensors ----------------------------------------------------------------------------------------------

class Env {
 public:
  Env(const DType dtype, const uint64_t seed, const Device device = Device::kCPU)
      : dtype_(dtype), device_(device), gen_(seed) {}

  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  // A tensor of `shape` whose values have magnitude in [0.1, 1) * scale and a random sign (never zero, never near
  // a kink such as relu's), or are positive.
  // `dtype` overrides the environment's (the low-precision cases mix dtypes).
  Tensor& rand(const std::string& name, std::vector<int64_t> shape, const double scale = 1.0,
               const bool positive = false, const std::optional<DType> dtype = std::nullopt) {
    Tensor t(std::move(shape), dtype.value_or(dtype_), MemCategory::kOther, device_);
    std::uniform_real_distribution<double> magnitude(0.1, 1.0);
    std::bernoulli_distribution negative(0.5);
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double v = magnitude(gen_) * scale;
      set(t, i, !positive && negative(gen_) ? -v : v);
    }
    return tensors_[name] = std::move(t);
  }

  // A tensor built by the case itself (integer indices, maps, a fixed pattern), put on the environment's device (a
  // copy when it was made elsewhere).
  Tensor& put(const std::string& name, Tensor t) {
    return tensors_[name] = t.device() == device_ ? std::move(t) : t.to(device_);
  }

  Tensor& operator()(const std::string& name) {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) throw std::logic_error("test case has no tensor '" + name + "'");
    return it->second;
  }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  const std::map<std::string, Tensor>& tensors() const { return tensors_; }

  // Deep copies of every tensor (Env copies share storage).
  std::map<std::string, Tensor> snapshot() const {
    std::map<std::string, Tensor> out;
    for (const auto& [name, t] : tensors_) out.emplace(name, t.clone());
    return out;
  }

  // Every tensor moved to `device` (copies: the values stay).
  void to(const Device device) {
    for (auto& [name, t] : tensors_) t = t.to(device);
    device_ = device;
  }

  // What some kernel wrote outside a tensor of this environment (the reference device's guard bytes), or "".
  std::string outside_writes() const {
    for (const auto& [name, t] : tensors_) {
      if (const std::string problem = moecore::outside_writes(t); !problem.empty()) return name + ": " + problem;
    }
    return "";
  }

 private:
  DType dtype_;
  Device device_;
  std::mt19937_64 gen_;
  std::map<std::string, Tensor> tensors_;
};

// ---- the case table ---------------------------------------------------------------------------------------------

// What a backward op does to a gradient buffer, as its header says.
enum class Contract { kAccumulates, kOverwrites };
struct GradOf {
  std::string input, grad;  // d loss / d input lands in grad
  Contract contract;
};
enum class Phase { kForward, kBackward };
// Replacing `tensor` with one of a wrong size, or of another dtype, must make `phase` throw std::invalid_argument
// whose message starts with "op: ".
struct BadArg {
  Phase phase;
  std::string tensor, op;
};

struct OpCase {
  OpCase(std::string case_name, std::vector<std::string> case_ops)
      : name(std::move(case_name)), ops(std::move(case_ops)) {}

  std::string name;              // test name suffix: letters, digits, underscores
  std::vector<std::string> ops;  // the ops/*.h functions this case runs
  // Inputs and forward outputs (outputs pre-filled with random values, so an op that reads its output shows).
  std::function<void(Env&)> build;
  std::function<void(Env&)> forward;
  std::vector<std::string> outputs;    // every tensor forward writes
  std::vector<std::string> loss;       // L = sum_o <o, w_o> with w_o = env["d" + o] (random)
  std::function<void(Env&)> backward;  // reads "d" + o, writes the grads; empty when the op has no backward
  std::vector<GradOf> grads;
  std::vector<BadArg> bad_args;

  bool has_backward() const { return static_cast<bool>(backward); }
};

// The case's tensors for `dtype`: build(), then w_o for each loss output and each gradient buffer, all random and
// the same for a given case and dtype (the seed is the case name's stream key).
inline Env make_env(const OpCase& c, const DType dtype, const Device device = Device::kCPU) {
  Env env(dtype, stream_key(c.name), device);
  c.build(env);
  for (const std::string& o : c.loss) env.rand("d" + o, env(o).shape());
  for (const GradOf& g : c.grads) env.rand(g.grad, env(g.input).shape());
  return env;
}

inline double weighted_loss(const OpCase& c, Env& env) {
  double total = 0.0;
  for (const std::string& o : c.loss) {
    const Tensor& out = env(o);
    const Tensor& w = env("d" + o);
    for (int64_t i = 0; i < out.numel(); ++i) total += get(out, i) * get(w, i);
  }
  return total;
}

// dst = src before an in-place forward op. Skipped when a bad-argument test swapped in a tensor of another size or
// dtype, so the op itself meets the bad tensor.
inline void reset(Tensor& dst, const Tensor& src) {
  if (dst.numel() == src.numel() && dst.dtype() == src.dtype()) dst.copy_from(src);
}

constexpr Contract kAcc = Contract::kAccumulates;
constexpr Contract kOver = Contract::kOverwrites;
constexpr Phase kFwd = Phase::kForward;
constexpr Phase kBwd = Phase::kBackward;

inline OpCase linear_case(const std::string& name, const std::vector<int64_t>& inp_shape, const int64_t O,
                          const bool bias, const bool weight_grad) {
  const int64_t I = inp_shape.back();
  std::vector<int64_t> out_shape = inp_shape;
  out_shape.back() = O;
  OpCase c{name, {"linear_forward", "linear_backward"}};
  c.build = [=](Env& e) {
    e.rand("inp", inp_shape);
    e.rand("weight", {O, I});
    if (bias) e.rand("bias", {O});
    e.rand("out", out_shape);
  };
  c.forward = [=](Env& e) { linear_forward(e("out"), e("inp"), e("weight"), bias ? &e("bias") : nullptr); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) {
    // Without a weight gradient the input may be omitted (the header allows inp_TI == nullptr then).
    linear_backward(&e("dinp"), weight_grad ? &e("dweight") : nullptr, bias ? &e("dbias") : nullptr, e("dout"),
                    weight_grad ? &e("inp") : nullptr, e("weight"));
  };
  c.grads = {{"inp", "dinp", kAcc}};
  if (weight_grad) c.grads.push_back({"weight", "dweight", kAcc});
  if (bias) c.grads.push_back({"bias", "dbias", kAcc});
  c.bad_args = {{kFwd, "inp", "linear_forward"},
                {kFwd, "out", "linear_forward"},
                {kBwd, "dout", "linear_backward"},
                {kBwd, "dinp", "linear_backward"}};
  if (bias) c.bad_args.push_back({kFwd, "bias", "linear_forward"});
  if (bias) c.bad_args.push_back({kBwd, "dbias", "linear_backward"});
  if (weight_grad) c.bad_args.push_back({kBwd, "dweight", "linear_backward"});
  return c;
}

inline OpCase rmsnorm_case(const std::string& name, const int64_t R, const int64_t D) {
  OpCase c{name, {"rmsnorm_forward", "rmsnorm_backward"}};
  c.build = [=](Env& e) {
    e.rand("inp", {R, D}, 2.0);
    e.rand("weight", {D});
    e.rand("out", {R, D});
    e.rand("rstd", {R});
  };
  c.forward = [](Env& e) { rmsnorm_forward(e("out"), e("rstd"), e("inp"), e("weight"), 1e-5); };
  c.outputs = {"out", "rstd"};
  c.loss = {"out"};
  c.backward = [](Env& e) { rmsnorm_backward(e("dinp"), e("dweight"), e("dout"), e("inp"), e("weight"), e("rstd")); };
  c.grads = {{"inp", "dinp", kAcc}, {"weight", "dweight", kAcc}};
  c.bad_args = {{kFwd, "inp", "rmsnorm_forward"},      {kFwd, "out", "rmsnorm_forward"},
                {kFwd, "rstd", "rmsnorm_forward"},     {kBwd, "dinp", "rmsnorm_backward"},
                {kBwd, "dweight", "rmsnorm_backward"}, {kBwd, "dout", "rmsnorm_backward"}};
  return c;
}

inline OpCase layernorm_case(const std::string& name, const std::vector<int64_t>& inp_shape, const bool bias) {
  const int64_t D = inp_shape.back();
  const std::vector<int64_t> stat_shape(inp_shape.begin(), inp_shape.end() - 1);
  OpCase c{name, {"layernorm_forward", "layernorm_backward"}};
  c.build = [=](Env& e) {
    e.rand("inp", inp_shape, 2.0);
    e.rand("weight", {D});
    if (bias) e.rand("bias", {D});
    e.rand("out", inp_shape);
    e.rand("mean", stat_shape);
    e.rand("rstd", stat_shape);
  };
  c.forward = [=](Env& e) {
    layernorm_forward(e("out"), e("mean"), e("rstd"), e("inp"), e("weight"), bias ? &e("bias") : nullptr, 1e-5);
  };
  c.outputs = {"out", "mean", "rstd"};
  c.loss = {"out"};
  c.backward = [=](Env& e) {
    layernorm_backward(e("dinp"), e("dweight"), bias ? &e("dbias") : nullptr, e("dout"), e("inp"), e("weight"),
                       e("mean"), e("rstd"));
  };
  c.grads = {{"inp", "dinp", kAcc}, {"weight", "dweight", kAcc}};
  if (bias) c.grads.push_back({"bias", "dbias", kAcc});
  c.bad_args = {{kFwd, "mean", "layernorm_forward"},
                {kFwd, "out", "layernorm_forward"},
                {kBwd, "dinp", "layernorm_backward"},
                {kBwd, "dweight", "layernorm_backward"}};
  if (bias) c.bad_args.push_back({kFwd, "bias", "layernorm_forward"});
  if (bias) c.bad_args.push_back({kBwd, "dbias", "layernorm_backward"});
  return c;
}

struct RopeShape {
  int64_t S, B, N, d, rot_dim;
  double base;
  int64_t position_offset;
};

inline OpCase rope_case(const std::string& name, const RopeShape& r) {
  const int64_t S = r.S, B = r.B, N = r.N, d = r.d, rot_dim = r.rot_dim, offset = r.position_offset;
  const double base = r.base;
  OpCase c{name, {"rope_forward", "rope_backward"}};
  c.build = [=](Env& e) {
    e.rand("inp", {S, B, N, d});
    e.rand("out", {S, B, N, d});
  };
  c.forward = [=](Env& e) { rope_forward(e("out"), e("inp"), S, B, d, rot_dim, base, offset); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) { rope_backward(e("dinp"), e("dout"), S, B, d, rot_dim, base, offset); };
  c.grads = {{"inp", "dinp", kAcc}};
  c.bad_args = {{kFwd, "inp", "rope_forward"}, {kFwd, "out", "rope_forward"}, {kBwd, "dinp", "rope_backward"}};
  return c;
}

// Per-row positions: packed documents (positions restart in each document, differently per batch row) or a
// context-parallel rank's two chunks.
inline OpCase rope_positions_case(const std::string& name, const RopeShape& r, const std::vector<int64_t>& positions) {
  const int64_t S = r.S, B = r.B, N = r.N, d = r.d, rot_dim = r.rot_dim;
  const double base = r.base;
  OpCase c{name, {"rope_forward", "rope_backward"}};
  c.build = [=](Env& e) {
    e.rand("inp", {S, B, N, d});
    e.rand("out", {S, B, N, d});
  };
  c.forward = [=](Env& e) { rope_forward(e("out"), e("inp"), S, B, d, rot_dim, base, positions); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) { rope_backward(e("dinp"), e("dout"), S, B, d, rot_dim, base, positions); };
  c.grads = {{"inp", "dinp", kAcc}};
  c.bad_args = {{kFwd, "inp", "rope_forward"}, {kFwd, "out", "rope_forward"}, {kBwd, "dinp", "rope_backward"}};
  return c;
}

// Any rotary embedding (kernels/cpu/rope.h): YaRN frequencies, a cos / sin factor, multi-latent attention's
// de-interleaved layout, over per-row positions.
inline OpCase rope_spec_case(const std::string& name, const int64_t S, const int64_t B, const int64_t N,
                             const kernels::RopeSpec& spec, const std::vector<int64_t>& positions) {
  const int64_t d = spec.head_dim;
  OpCase c{name, {"rope_forward", "rope_backward"}};
  c.build = [=](Env& e) {
    e.rand("inp", {S, B, N, d});
    e.rand("out", {S, B, N, d});
  };
  c.forward = [=](Env& e) { rope_forward(e("out"), e("inp"), S, B, spec, positions); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) { rope_backward(e("dinp"), e("dout"), S, B, spec, positions); };
  c.grads = {{"inp", "dinp", kAcc}};
  c.bad_args = {{kFwd, "inp", "rope_forward"}, {kFwd, "out", "rope_forward"}, {kBwd, "dinp", "rope_backward"}};
  return c;
}

// A multi-latent attention rope spec: YaRN frequencies over rot_dim channels (scaling factor 40 over an original
// length of 16 positions, so the ramp lies inside the channels), concentration 1.2, the de-interleaved layout.
inline kernels::RopeSpec mla_yarn_spec(const int64_t head_dim, const int64_t rot_dim, const bool interleaved) {
  kernels::YarnParams yarn;
  yarn.scaling_factor = 40.0;
  yarn.original_max_position_embeddings = 16;
  yarn.beta_fast = 4.0;
  yarn.beta_slow = 0.5;
  return kernels::RopeSpec{head_dim, kernels::yarn_inv_freq(rot_dim, 10000.0, yarn), 1.2f, interleaved};
}

// Positions of S rows of B batch rows restarting at 0 every `period` rows, shifted by b in batch row b.
inline std::vector<int64_t> document_positions(const int64_t S, const int64_t B, const int64_t period) {
  std::vector<int64_t> positions(static_cast<size_t>(S * B));
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) positions[static_cast<size_t>(s * B + b)] = (s + b) % period;
  }
  return positions;
}

// Rows of context-parallel rank r of cp with chunks of `chunk` rows: chunks r and 2 cp - 1 - r.
inline std::vector<int64_t> cp_rows(const int64_t cp, const int64_t r, const int64_t chunk) {
  std::vector<int64_t> rows;
  for (const int64_t c : {r, 2 * cp - 1 - r}) {
    for (int64_t i = 0; i < chunk; ++i) rows.push_back(c * chunk + i);
  }
  return rows;
}

// The same positions in each of B batch rows.
inline std::vector<int64_t> repeat_per_batch(const std::vector<int64_t>& rows, const int64_t B) {
  std::vector<int64_t> out;
  for (const int64_t r : rows) out.insert(out.end(), static_cast<size_t>(B), r);
  return out;
}

// The index and document arrays of a block attention, which the case's AttentionDims point into; the case's
// lambdas keep them alive.
struct BlockArrays {
  int64_t Sk = 0;
  std::vector<int64_t> q_index, k_index;  // empty: none
  std::vector<int32_t> q_doc, k_doc;      // empty: none
  int64_t dropout_seq_len = 0;
};
using BlockArraysPtr = std::shared_ptr<const BlockArrays>;

inline AttentionDims with_arrays(AttentionDims dims, const BlockArraysPtr& arrays) {
  if (!arrays) return dims;
  dims.Sk = arrays->Sk;
  dims.q_index = arrays->q_index.empty() ? nullptr : arrays->q_index.data();
  dims.k_index = arrays->k_index.empty() ? nullptr : arrays->k_index.data();
  dims.q_document_SB = arrays->q_doc.empty() ? nullptr : arrays->q_doc.data();
  dims.k_document_SB = arrays->k_doc.empty() ? nullptr : arrays->k_doc.data();
  dims.dropout_seq_len = arrays->dropout_seq_len;
  return dims;
}

// Document ids of rows [S, B]: document boundaries at the rows in `starts` (ascending), offset by 10 b per batch
// row, and in batch row 1 every row past the first boundary moved one document on.
inline std::vector<int32_t> documents_SB(const std::vector<int64_t>& rows, const int64_t B,
                                         const std::vector<int64_t>& starts) {
  std::vector<int32_t> doc;
  for (const int64_t r : rows) {
    int32_t id = 0;
    for (const int64_t start : starts) id += r >= start ? 1 : 0;
    for (int64_t b = 0; b < B; ++b) doc.push_back(static_cast<int32_t>(10 * b) + id + (b == 1 && id > 0 ? 1 : 0));
  }
  return doc;
}

inline int64_t value_dim(const AttentionDims& dims) { return dims.v_head_dim > 0 ? dims.v_head_dim : dims.head_dim; }

// GQA with N = 4 query heads over G = 2 groups (or a tensor-parallel shard of them); with arrays, a block of the
// sequence (indices, documents, Sk key rows). Value heads are dims.v_head_dim wide (0: head_dim).
inline OpCase attention_case(const std::string& name, const AttentionDims& base_dims, const DropoutSpec& dropout,
                             const BlockArraysPtr& arrays = nullptr) {
  const int64_t S = base_dims.S, B = base_dims.B, N = base_dims.N, G = base_dims.G, d = base_dims.head_dim;
  const int64_t Sk = arrays && arrays->Sk > 0 ? arrays->Sk : S, dv = value_dim(base_dims);
  OpCase c{name, {"attention_forward", "attention_backward"}};
  c.build = [=](Env& e) {
    e.rand("q", {S, B, N, d}, 1.5);
    e.rand("k", {Sk, B, G, d}, 1.5);
    e.rand("v", {Sk, B, G, dv});
    e.rand("out", {S, B, N, dv});
    e.rand("lse", {B, N, S});
  };
  c.forward = [=](Env& e) {
    attention_forward(e("out"), e("lse"), e("q"), e("k"), e("v"), with_arrays(base_dims, arrays), dropout);
  };
  c.outputs = {"out", "lse"};
  c.loss = {"out"};
  c.backward = [=](Env& e) {
    attention_backward(e("dq"), e("dk"), e("dv"), e("dout"), e("q"), e("k"), e("v"), e("out"), e("lse"),
                       with_arrays(base_dims, arrays), dropout);
  };
  c.grads = {{"q", "dq", kAcc}, {"k", "dk", kAcc}, {"v", "dv", kAcc}};
  c.bad_args = {{kFwd, "k", "attention_forward"},   {kFwd, "lse", "attention_forward"},
                {kFwd, "out", "attention_forward"}, {kBwd, "dv", "attention_backward"},
                {kBwd, "dq", "attention_backward"}, {kBwd, "dout", "attention_backward"}};
  return c;
}

inline AttentionDims attention_dims(const int64_t S, const int64_t B, const int64_t N, const int64_t G) {
  AttentionDims dims;
  dims.S = S;
  dims.B = B;
  dims.N = N;
  dims.G = G;
  dims.head_dim = 8;
  dims.scale = 1.0 / std::sqrt(8.0);
  return dims;
}

// The same with value heads dv wide (multi-latent attention).
inline AttentionDims attention_dims(const int64_t S, const int64_t B, const int64_t N, const int64_t G,
                                    const int64_t dv) {
  AttentionDims dims = attention_dims(S, B, N, G);
  dims.v_head_dim = dv;
  return dims;
}

// Context-parallel rank r of cp (chunks of `chunk` rows) against the keys of rank s, with documents starting at
// the rows `doc_starts` of the whole sequence (none: one document).
inline BlockArraysPtr cp_block(const int64_t cp, const int64_t r, const int64_t s, const int64_t chunk, const int64_t B,
                               const std::vector<int64_t>& doc_starts) {
  auto arrays = std::make_shared<BlockArrays>();
  arrays->q_index = cp_rows(cp, r, chunk);
  arrays->k_index = cp_rows(cp, s, chunk);
  arrays->Sk = 2 * chunk;
  arrays->dropout_seq_len = 2 * cp * chunk;
  if (!doc_starts.empty()) {
    arrays->q_doc = documents_SB(arrays->q_index, B, doc_starts);
    arrays->k_doc = documents_SB(arrays->k_index, B, doc_starts);
  }
  return arrays;
}

// Packed documents in a whole sequence of S rows (self-attention, no indices).
inline BlockArraysPtr packed_documents(const int64_t S, const int64_t B, const std::vector<int64_t>& doc_starts) {
  auto arrays = std::make_shared<BlockArrays>();
  std::vector<int64_t> rows(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) rows[static_cast<size_t>(i)] = i;
  arrays->q_doc = arrays->k_doc = documents_SB(rows, B, doc_starts);
  return arrays;
}

// attention_merge alone: (out0, lse0) merged with (pout, plse) into (out, lse); some rows of either side (and of
// both) saw no key (lse -inf).
inline OpCase attention_merge_case(const std::string& name, const AttentionDims& dims) {
  const int64_t S = dims.S, B = dims.B, N = dims.N, d = value_dim(dims);
  OpCase c{name, {"attention_merge"}};
  c.build = [=](Env& e) {
    e.rand("out0", {S, B, N, d});
    e.rand("lse0", {B, N, S}, 3.0);
    e.rand("pout", {S, B, N, d});
    e.rand("plse", {B, N, S}, 3.0);
    e.rand("out", {S, B, N, d});
    e.rand("lse", {B, N, S});
    const double inf = std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < B * N * S; i += 3) set(e("lse0"), i, -inf);
    for (int64_t i = 0; i < B * N * S; i += 4) set(e("plse"), i, -inf);
  };
  c.forward = [=](Env& e) {
    reset(e("out"), e("out0"));
    reset(e("lse"), e("lse0"));
    attention_merge(e("out"), e("lse"), e("pout"), e("plse"), dims);
  };
  c.outputs = {"out", "lse"};
  c.bad_args = {{kFwd, "out", "attention_merge"},
                {kFwd, "lse", "attention_merge"},
                {kFwd, "pout", "attention_merge"},
                {kFwd, "plse", "attention_merge"}};
  return c;
}

// Ring attention of one context-parallel rank over two key blocks (its own, a's, and another rank's, b's): forward
// per block, merged; backward per block with the final out and lse, dq summed. The finite differences check that
// this is the gradient of the merged attention.
inline OpCase attention_ring_case(const std::string& name, const AttentionDims& base_dims, const DropoutSpec& dropout,
                                  const BlockArraysPtr& a, const BlockArraysPtr& b) {
  const int64_t S = base_dims.S, B = base_dims.B, N = base_dims.N, G = base_dims.G, d = base_dims.head_dim,
                dv = value_dim(base_dims);
  OpCase c{name, {"attention_forward", "attention_merge", "attention_backward"}};
  c.build = [=](Env& e) {
    e.rand("q", {S, B, N, d}, 1.5);
    e.rand("ka", {a->Sk, B, G, d}, 1.5);
    e.rand("va", {a->Sk, B, G, dv});
    e.rand("kb", {b->Sk, B, G, d}, 1.5);
    e.rand("vb", {b->Sk, B, G, dv});
    e.rand("out", {S, B, N, dv});
    e.rand("lse", {B, N, S});
    e.rand("pout", {S, B, N, dv});
    e.rand("plse", {B, N, S});
  };
  c.forward = [=](Env& e) {
    attention_forward(e("out"), e("lse"), e("q"), e("ka"), e("va"), with_arrays(base_dims, a), dropout);
    attention_forward(e("pout"), e("plse"), e("q"), e("kb"), e("vb"), with_arrays(base_dims, b), dropout);
    attention_merge(e("out"), e("lse"), e("pout"), e("plse"), base_dims);
  };
  c.outputs = {"out", "lse", "pout", "plse"};
  c.loss = {"out"};
  c.backward = [=](Env& e) {
    attention_backward(e("dq"), e("dka"), e("dva"), e("dout"), e("q"), e("ka"), e("va"), e("out"), e("lse"),
                       with_arrays(base_dims, a), dropout);
    attention_backward(e("dq"), e("dkb"), e("dvb"), e("dout"), e("q"), e("kb"), e("vb"), e("out"), e("lse"),
                       with_arrays(base_dims, b), dropout);
  };
  c.grads = {{"q", "dq", kAcc}, {"ka", "dka", kAcc}, {"va", "dva", kAcc}, {"kb", "dkb", kAcc}, {"vb", "dvb", kAcc}};
  c.bad_args = {{kFwd, "kb", "attention_forward"}, {kBwd, "dkb", "attention_backward"}};
  return c;
}

inline OpCase activation_case(const std::string& name, const Activation kind, const int64_t T, const int64_t F) {
  const int64_t F1 = activation_input_width(kind, F);
  OpCase c{name, {"activation_forward", "activation_backward"}};
  c.build = [=](Env& e) {
    e.rand("inp", {T, F1}, 2.0);
    e.rand("out", {T, F});
  };
  c.forward = [=](Env& e) { activation_forward(kind, e("out"), e("inp")); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) { activation_backward(kind, e("dinp"), e("dout"), e("inp")); };
  c.grads = {{"inp", "dinp", kAcc}};
  c.bad_args = {{kFwd, "inp", "activation_forward"},
                {kFwd, "out", "activation_forward"},
                {kBwd, "dinp", "activation_backward"},
                {kBwd, "dout", "activation_backward"}};
  return c;
}

// Gates over [-6, 6] (both branches of the sigmoid), positive probabilities; the backward overwrites both gradients.
inline OpCase weighted_swiglu_case(const std::string& name, const int64_t T, const int64_t F) {
  OpCase c{name, {"weighted_swiglu_forward", "weighted_swiglu_backward"}};
  c.build = [=](Env& e) {
    e.rand("inp", {T, 2 * F}, 6.0);
    e.rand("probs", {T}, 1.0, true);
    e.rand("h", {T, F});
  };
  c.forward = [](Env& e) { weighted_swiglu_forward(e("h"), e("inp"), e("probs")); };
  c.outputs = {"h"};
  c.loss = {"h"};
  c.backward = [](Env& e) { weighted_swiglu_backward(e("dinp"), e("dprobs"), e("dh"), e("inp"), e("probs")); };
  c.grads = {{"inp", "dinp", kOver}, {"probs", "dprobs", kOver}};
  c.bad_args = {{kFwd, "inp", "weighted_swiglu_forward"},     {kFwd, "h", "weighted_swiglu_forward"},
                {kFwd, "probs", "weighted_swiglu_forward"},   {kBwd, "dinp", "weighted_swiglu_backward"},
                {kBwd, "dprobs", "weighted_swiglu_backward"}, {kBwd, "dh", "weighted_swiglu_backward"}};
  return c;
}

// p = 0.3, fixed seed / key, and an element offset (a shard of a larger tensor).
inline DropoutSpec test_dropout() {
  DropoutSpec spec;
  spec.p = 0.3f;
  spec.seed = 1234;
  spec.key = 77;
  spec.offset = 5;
  return spec;
}

inline OpCase dropout_case(const std::string& name, const std::vector<int64_t>& shape) {
  const DropoutSpec spec = test_dropout();
  OpCase c{name, {"dropout_forward", "dropout_backward"}};
  c.build = [=](Env& e) {
    e.rand("inp", shape);
    e.rand("out", shape);
  };
  c.forward = [=](Env& e) { dropout_forward(e("out"), e("inp"), spec); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) { dropout_backward(e("dinp"), e("dout"), spec); };
  c.grads = {{"inp", "dinp", kAcc}};
  c.bad_args = {{kFwd, "out", "dropout_forward"}, {kBwd, "dinp", "dropout_backward"}};
  return c;
}

// Targets spread over [0, V): (5 t + 3) mod V.
inline std::vector<int32_t> spread_ids(const int64_t T, const int64_t V) {
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ids[static_cast<size_t>(t)] = static_cast<int32_t>((5 * t + 3) % V);
  return ids;
}

inline OpCase cross_entropy_case(const std::string& name, const int64_t T, const int64_t V) {
  const std::vector<int32_t> targets = spread_ids(T, V);
  OpCase c{name, {"cross_entropy_forward", "cross_entropy_backward"}};
  c.build = [=](Env& e) {
    e.rand("logits", {T, V}, 3.0);
    e.rand("losses", {T});
    e.rand("lse", {T});
  };
  c.forward = [=](Env& e) { cross_entropy_forward(e("losses"), e("lse"), e("logits"), targets); };
  c.outputs = {"losses", "lse"};
  c.loss = {"losses"};
  c.backward = [=](Env& e) { cross_entropy_backward(e("dlogits"), e("dlosses"), e("logits"), e("lse"), targets); };
  c.grads = {{"logits", "dlogits", kOver}};
  c.bad_args = {{kFwd, "logits", "cross_entropy_forward"},
                {kFwd, "losses", "cross_entropy_forward"},
                {kFwd, "lse", "cross_entropy_forward"},
                {kBwd, "dlogits", "cross_entropy_backward"},
                {kBwd, "dlosses", "cross_entropy_backward"}};
  return c;
}

// One rank's piece of a vocabulary-parallel cross-entropy: columns [7, 13) of V = 20, targets inside (7, 12, 9, 10)
// and outside (0, 19, 6, 13) of them; with one rank the group's max and stats are this rank's.
inline OpCase vocab_ce_case() {
  constexpr int64_t T = 8, V = 20, begin = 7, Vl = 6;
  const std::vector<int32_t> targets = {7, 0, 12, 19, 9, 6, 13, 10};
  OpCase c{"vocab_parallel_cross_entropy",
           {"vocab_ce_local_max", "vocab_ce_local_stats", "vocab_ce_finish", "vocab_ce_backward"}};
  c.build = [](Env& e) {
    e.rand("logits", {T, Vl}, 3.0);
    e.rand("max", {T});
    e.rand("stats", {2, T});
    e.rand("losses", {T});
    e.rand("lse", {T});
  };
  c.forward = [=](Env& e) {
    vocab_ce_local_max(e("max"), e("logits"));
    vocab_ce_local_stats(e("stats"), e("logits"), e("max"), targets, V, begin);
    vocab_ce_finish(e("losses"), e("lse"), e("max"), e("stats"));
  };
  c.outputs = {"max", "stats", "losses", "lse"};
  c.loss = {"losses"};
  c.backward = [=](Env& e) { vocab_ce_backward(e("dlogits"), e("dlosses"), e("logits"), e("lse"), targets, begin); };
  c.grads = {{"logits", "dlogits", kOver}};
  c.bad_args = {{kFwd, "logits", "vocab_ce_local_max"},  {kFwd, "max", "vocab_ce_local_max"},
                {kFwd, "stats", "vocab_ce_local_stats"}, {kFwd, "losses", "vocab_ce_finish"},
                {kFwd, "lse", "vocab_ce_finish"},        {kBwd, "dlogits", "vocab_ce_backward"},
                {kBwd, "dlosses", "vocab_ce_backward"}};
  return c;
}

// The fused output layer + cross-entropy over chunks of 3 of T = 8 tokens (a last chunk of 2). Its backward is the
// same op with dlosses: it recomputes the losses into a scratch tensor and accumulates the input and weight
// gradients. With begin >= 0 the weight holds columns [begin, begin + Vl) of V and the group's reductions are this
// rank's own values (one rank), as in vocab_ce_case.
inline OpCase linear_cross_entropy_case(const std::string& name, const int64_t V, const int64_t begin, const int64_t Vl,
                                        const std::vector<int32_t>& targets) {
  constexpr int64_t I = 5, chunk = 3;
  const auto T = static_cast<int64_t>(targets.size());
  const bool split = begin >= 0;
  OpCase c{name, {"linear_cross_entropy"}};
  c.build = [=](Env& e) {
    e.rand("inp", {T, I});
    e.rand("weight", {Vl, I}, 2.0);
    e.rand("losses", {T});
  };
  const auto shard = [=]() {
    VocabShard s{V, begin, [](Tensor&) {}, [](Tensor&) {}};
    return s;
  };
  c.forward = [=](Env& e) {
    const VocabShard s = shard();
    linear_cross_entropy(e("losses"), e("inp"), e("weight"), targets, chunk, nullptr, nullptr, nullptr,
                         split ? &s : nullptr);
  };
  c.outputs = {"losses"};
  c.loss = {"losses"};
  c.backward = [=](Env& e) {
    const VocabShard s = shard();
    Tensor scratch_losses({T}, e.dtype(), MemCategory::kOther, e.device());
    linear_cross_entropy(scratch_losses, e("inp"), e("weight"), targets, chunk, &e("dlosses"), &e("dinp"),
                         &e("dweight"), split ? &s : nullptr);
  };
  c.grads = {{"inp", "dinp", kAcc}, {"weight", "dweight", kAcc}};
  c.bad_args = {{kFwd, "inp", "linear_cross_entropy"},
                {kFwd, "losses", "linear_cross_entropy"},
                {kBwd, "dinp", "linear_cross_entropy"},
                {kBwd, "dweight", "linear_cross_entropy"},
                {kBwd, "dlosses", "linear_cross_entropy"}};
  return c;
}

inline OpCase embedding_case(const std::string& name, const int64_t V, const int64_t begin, const int64_t Vl,
                             const std::vector<int32_t>& ids) {
  constexpr int64_t D = 5;
  const auto T = static_cast<int64_t>(ids.size());
  OpCase c{name, {"embedding_forward", "embedding_backward"}};
  c.build = [=](Env& e) {
    e.rand("weight", {Vl, D});
    e.rand("out", {T, D});
  };
  c.forward = [=](Env& e) { embedding_forward(e("out"), ids, e("weight"), V, begin); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) { embedding_backward(e("dweight"), e("dout"), ids, begin); };
  c.grads = {{"weight", "dweight", kAcc}};
  c.bad_args = {{kFwd, "out", "embedding_forward"},
                {kBwd, "dweight", "embedding_backward"},
                {kBwd, "dout", "embedding_backward"}};
  return c;
}

// In-place forward ops (y += ..., y *= ...) run on a copy of the input y0, so forward is a function of its inputs.
inline OpCase add_case(const std::string& name, const std::vector<int64_t>& shape) {
  OpCase c{name, {"add_"}};
  c.build = [=](Env& e) {
    e.rand("y0", shape);
    e.rand("x", shape);
    e.rand("y", shape);
  };
  c.forward = [](Env& e) {
    reset(e("y"), e("y0"));
    add_(e("y"), e("x"));
  };
  c.outputs = {"y"};
  c.bad_args = {{kFwd, "x", "add_"}};
  return c;
}

inline OpCase scale_case(const std::string& name, const std::vector<int64_t>& shape) {
  OpCase c{name, {"scale_"}};
  c.build = [=](Env& e) {
    e.rand("y0", shape);
    e.rand("y", shape);
  };
  c.forward = [](Env& e) {
    reset(e("y"), e("y0"));
    scale_(e("y"), -0.75);
  };
  c.outputs = {"y"};
  return c;
}

inline AdamWHyper test_adamw_hyper() {
  AdamWHyper hyper;
  hyper.lr = 1e-2;
  hyper.beta1 = 0.9;
  hyper.beta2 = 0.95;
  hyper.eps = 1e-8;
  hyper.weight_decay = 0.1;
  hyper.step = 3;
  hyper.grad_scale = 0.75f;  // a clipping coefficient
  return hyper;
}

inline OpCase adamw_case(const std::string& name, const std::vector<int64_t>& shape) {
  OpCase c{name, {"adamw_step"}};
  c.build = [=](Env& e) {
    e.rand("param0", shape);
    e.rand("grad", shape);
    e.rand("exp_avg0", shape, 0.1);
    e.rand("exp_avg_sq0", shape, 0.01, true);
    e.rand("param", shape);
    e.rand("exp_avg", shape);
    e.rand("exp_avg_sq", shape);
  };
  c.forward = [](Env& e) {
    reset(e("param"), e("param0"));
    reset(e("exp_avg"), e("exp_avg0"));
    reset(e("exp_avg_sq"), e("exp_avg_sq0"));
    adamw_step(e("param"), e("grad"), e("exp_avg"), e("exp_avg_sq"), test_adamw_hyper());
  };
  c.outputs = {"param", "exp_avg", "exp_avg_sq"};
  c.bad_args = {{kFwd, "grad", "adamw_step"}};
  return c;
}

// Fused qkv rows of N heads in G groups, d wide; split and merge are each other's backward (both overwrite).
struct QkvShape {
  int64_t T, N, G, d;
};

inline void build_qkv(Env& e, const QkvShape& s) {
  e.rand("qkv", {s.T, (s.N + 2 * s.G) * s.d});
  e.rand("q", {s.T, s.N, s.d});
  e.rand("k", {s.T, s.G, s.d});
  e.rand("v", {s.T, s.G, s.d});
}

inline OpCase split_qkv_case(const std::string& name, const QkvShape& s) {
  OpCase c{name, {"split_qkv", "merge_qkv"}};
  c.build = [=](Env& e) { build_qkv(e, s); };
  c.forward = [=](Env& e) { split_qkv(e("q"), e("k"), e("v"), e("qkv"), s.N, s.G, s.d); };
  c.outputs = {"q", "k", "v"};
  c.loss = {"q", "k", "v"};
  c.backward = [=](Env& e) { merge_qkv(e("dqkv"), e("dq"), e("dk"), e("dv"), s.N, s.G, s.d); };
  c.grads = {{"qkv", "dqkv", kOver}};
  c.bad_args = {
      {kFwd, "qkv", "split_qkv"}, {kFwd, "q", "split_qkv"}, {kBwd, "dqkv", "merge_qkv"}, {kBwd, "dk", "merge_qkv"}};
  return c;
}

// copy_columns as the split of [R, a + b] rows into the b-wide block at column a (forward) and its gradient added
// back (backward: the same op with accumulate).
inline OpCase copy_columns_case(const std::string& name, const int64_t R, const int64_t a, const int64_t b) {
  OpCase c{name, {"copy_columns"}};
  c.build = [=](Env& e) {
    e.rand("x", {R, a + b});
    e.rand("y", {R, b});
  };
  c.forward = [=](Env& e) { copy_columns(e("y"), b, 0, e("x"), a + b, a, b); };
  c.outputs = {"y"};
  c.loss = {"y"};
  c.backward = [=](Env& e) { copy_columns(e("dx"), a + b, a, e("dy"), b, 0, b, true); };
  c.grads = {{"x", "dx", kAcc}};
  c.bad_args = {{kFwd, "x", "copy_columns"}, {kFwd, "y", "copy_columns"}, {kBwd, "dx", "copy_columns"}};
  return c;
}

inline OpCase merge_qkv_case(const std::string& name, const QkvShape& s) {
  OpCase c{name, {"merge_qkv", "split_qkv"}};
  c.build = [=](Env& e) { build_qkv(e, s); };
  c.forward = [=](Env& e) { merge_qkv(e("qkv"), e("q"), e("k"), e("v"), s.N, s.G, s.d); };
  c.outputs = {"qkv"};
  c.loss = {"qkv"};
  c.backward = [=](Env& e) { split_qkv(e("dq"), e("dk"), e("dv"), e("dqkv"), s.N, s.G, s.d); };
  c.grads = {{"q", "dq", kOver}, {"k", "dk", kOver}, {"v", "dv", kOver}};
  c.bad_args = {{kFwd, "v", "merge_qkv"}, {kFwd, "qkv", "merge_qkv"}, {kBwd, "dq", "split_qkv"}};
  return c;
}

inline OpCase add_bias_rows_case(const std::string& name, const int64_t R, const int64_t W) {
  OpCase c{name, {"add_bias_rows", "bias_grad_rows"}};
  c.build = [=](Env& e) {
    e.rand("y0", {R, W});
    e.rand("bias", {W});
    e.rand("y", {R, W});
  };
  c.forward = [](Env& e) {
    reset(e("y"), e("y0"));
    add_bias_rows(e("y"), e("bias"));
  };
  c.outputs = {"y"};
  c.loss = {"y"};
  c.backward = [](Env& e) { bias_grad_rows(e("dbias"), e("dy")); };
  c.grads = {{"bias", "dbias", kAcc}};
  c.bad_args = {{kFwd, "bias", "add_bias_rows"}, {kBwd, "dbias", "bias_grad_rows"}, {kBwd, "dy", "bias_grad_rows"}};
  return c;
}

inline OpCase scale_rows_case(const std::string& name, const int64_t R, const int64_t W) {
  OpCase c{name, {"scale_rows", "scale_rows_backward"}};
  c.build = [=](Env& e) {
    e.rand("x", {R, W});
    e.rand("s", {R});
    e.rand("out", {R, W});
  };
  c.forward = [](Env& e) { scale_rows(e("out"), e("x"), e("s")); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [](Env& e) { scale_rows_backward(&e("dx"), &e("ds"), e("dout"), e("x"), e("s")); };
  c.grads = {{"x", "dx", kAcc}, {"s", "ds", kOver}};
  c.bad_args = {{kFwd, "x", "scale_rows"},
                {kFwd, "out", "scale_rows"},
                {kBwd, "dx", "scale_rows_backward"},
                {kBwd, "ds", "scale_rows_backward"},
                {kBwd, "dout", "scale_rows_backward"}};
  return c;
}

inline OpCase add_outer_case(const std::string& name, const int64_t R, const int64_t W) {
  OpCase c{name, {"add_outer", "add_outer_backward"}};
  c.build = [=](Env& e) {
    e.rand("y0", {R, W});
    e.rand("s", {R});
    e.rand("b", {W});
    e.rand("y", {R, W});
  };
  c.forward = [](Env& e) {
    reset(e("y"), e("y0"));
    add_outer(e("y"), e("s"), e("b"));
  };
  c.outputs = {"y"};
  c.loss = {"y"};
  c.backward = [](Env& e) { add_outer_backward(&e("ds"), &e("db"), e("dy"), e("s"), e("b")); };
  c.grads = {{"s", "ds", kAcc}, {"b", "db", kAcc}};
  c.bad_args = {{kFwd, "s", "add_outer"},
                {kFwd, "b", "add_outer"},
                {kBwd, "ds", "add_outer_backward"},
                {kBwd, "db", "add_outer_backward"},
                {kBwd, "dy", "add_outer_backward"}};
  return c;
}

inline OpCase sigmoid_case(const std::string& name, const std::vector<int64_t>& shape) {
  OpCase c{name, {"sigmoid_forward", "sigmoid_backward"}};
  c.build = [=](Env& e) {
    e.rand("x", shape);
    e.rand("out", shape);
  };
  c.forward = [](Env& e) { sigmoid_forward(e("out"), e("x")); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [](Env& e) { sigmoid_backward(e("dx"), e("dout"), e("out")); };
  c.grads = {{"x", "dx", kAcc}};
  c.bad_args = {{kFwd, "x", "sigmoid_forward"},
                {kFwd, "out", "sigmoid_forward"},
                {kBwd, "dx", "sigmoid_backward"},
                {kBwd, "dout", "sigmoid_backward"}};
  return c;
}

// row_dot has no backward op of its own: its gradients are add_outer (dx += dout w^T) and add_outer_backward's
// db (dw += sum_r dout[r] x[r]), as a router or gate would compose them.
inline OpCase row_dot_case(const std::string& name, const int64_t R, const int64_t W) {
  OpCase c{name, {"row_dot"}};
  c.build = [=](Env& e) {
    e.rand("x", {R, W});
    e.rand("w", {W});
    e.rand("out", {R});
  };
  c.forward = [](Env& e) { row_dot(e("out"), e("x"), e("w")); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [](Env& e) {
    add_outer(e("dx"), e("dout"), e("w"));
    add_outer_backward(nullptr, &e("dw"), e("x"), e("dout"), e("w"));
  };
  c.grads = {{"x", "dx", kAcc}, {"w", "dw", kAcc}};
  c.bad_args = {{kFwd, "x", "row_dot"}, {kFwd, "out", "row_dot"}};
  return c;
}

// R row indices into N rows: (7 r + 3) mod (N + 1) - 1, so rows repeat and -1 (no row) occurs.
inline std::vector<int64_t> spread_row_index(const int64_t R, const int64_t N) {
  std::vector<int64_t> index(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) index[static_cast<size_t>(r)] = (7 * r + 3) % (N + 1) - 1;
  return index;
}

inline OpCase gather_rows_case(const std::string& name, const int64_t N, const int64_t R, const int64_t W) {
  const std::vector<int64_t> index = spread_row_index(R, N);
  OpCase c{name, {"gather_rows", "scatter_add_rows"}};
  c.build = [=](Env& e) {
    e.rand("in", {N, W});
    e.rand("out", {R, W});
  };
  c.forward = [=](Env& e) { gather_rows(e("out"), e("in"), index); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) { scatter_add_rows(e("din"), e("dout"), index); };
  c.grads = {{"in", "din", kAcc}};
  c.bad_args = {{kFwd, "out", "gather_rows"}, {kBwd, "din", "scatter_add_rows"}, {kBwd, "dout", "scatter_add_rows"}};
  return c;
}

inline OpCase scatter_add_rows_case(const std::string& name, const int64_t N, const int64_t R, const int64_t W) {
  const std::vector<int64_t> index = spread_row_index(R, N);
  OpCase c{name, {"scatter_add_rows", "gather_rows"}};
  c.build = [=](Env& e) {
    e.rand("out0", {N, W});
    e.rand("in", {R, W});
    e.rand("out", {N, W});
  };
  c.forward = [=](Env& e) {
    reset(e("out"), e("out0"));
    scatter_add_rows(e("out"), e("in"), index);
  };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) { gather_rows(e("din"), e("dout"), index); };
  c.grads = {{"in", "din", kOver}};
  c.bad_args = {{kFwd, "in", "scatter_add_rows"}, {kBwd, "din", "gather_rows"}};
  return c;
}

// Megatron's permute of N token rows into R expert rows (rows repeat; -1: padding rows), and back.
inline OpCase moe_permute_case(const std::string& name, const int64_t N, const int64_t R, const int64_t W) {
  const std::vector<int64_t> index = spread_row_index(R, N);
  OpCase c{name, {"moe_permute", "moe_unpermute"}};
  c.build = [=](Env& e) {
    e.rand("in", {N, W});
    e.rand("out", {R, W});
  };
  c.forward = [=](Env& e) { moe_permute(e("out"), e("in"), index); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) { moe_unpermute(e("din"), e("dout"), index); };
  c.grads = {{"in", "din", kAcc}};
  c.bad_args = {{kFwd, "out", "moe_permute"}, {kFwd, "in", "moe_permute"}, {kBwd, "din", "moe_unpermute"}};
  return c;
}

// Megatron's unpermute: R expert rows scatter-added into N tokens, weighted by their probabilities or not.
inline OpCase moe_unpermute_case(const std::string& name, const int64_t N, const int64_t R, const int64_t W,
                                 const bool probs) {
  const std::vector<int64_t> index = spread_row_index(R, N);
  OpCase c{name, {"moe_unpermute", "moe_unpermute_backward"}};
  c.build = [=](Env& e) {
    e.rand("out0", {N, W});
    e.rand("in", {R, W});
    if (probs) e.rand("probs", {R}, 1.0, true);
    e.rand("out", {N, W});
  };
  c.forward = [=](Env& e) {
    reset(e("out"), e("out0"));
    moe_unpermute(e("out"), e("in"), index, probs ? &e("probs") : nullptr);
  };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) {
    if (probs) {
      moe_unpermute_backward(&e("din"), &e("dprobs"), e("dout"), index, &e("probs"), &e("in"));
    } else {
      moe_unpermute_backward(&e("din"), nullptr, e("dout"), index);
    }
  };
  c.grads = {{"in", "din", kOver}};
  if (probs) c.grads.push_back({"probs", "dprobs", kOver});
  c.bad_args = {{kFwd, "in", "moe_unpermute"}, {kFwd, "out", "moe_unpermute"}, {kBwd, "din", "moe_unpermute_backward"}};
  if (probs) {
    c.bad_args.push_back({kFwd, "probs", "moe_unpermute"});
    c.bad_args.push_back({kBwd, "dprobs", "moe_unpermute_backward"});
  }
  return c;
}

// C chunks of N rows (sizes 0, 1, 2, ..., in a shuffled order) tiling the first rows of N: Megatron's
// sort_chunks_by_idxs of the all-to-all output; the rows after the last chunk belong to none (a padded buffer).
struct ChunkList {
  std::vector<int64_t> first, rows;
  int64_t total = 0;
};
inline ChunkList shuffled_chunks(const int64_t C) {
  ChunkList ch;
  std::vector<int64_t> first_C(static_cast<size_t>(C)), rows_C(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) {
    first_C[static_cast<size_t>(c)] = ch.total;
    rows_C[static_cast<size_t>(c)] = c % 4;
    ch.total += c % 4;
  }
  for (int64_t i = 0; i < C; ++i) {
    const auto c = static_cast<size_t>((5 * i + 2) % C);
    ch.first.push_back(first_C[c]);
    ch.rows.push_back(rows_C[c]);
  }
  return ch;
}

inline OpCase sort_chunks_case(const std::string& name, const int64_t C, const int64_t W) {
  const ChunkList ch = shuffled_chunks(C);
  const int64_t N = ch.total + 3;
  OpCase c{name, {"sort_chunks", "unsort_chunks"}};
  c.build = [=](Env& e) {
    e.rand("in", {N, W});
    e.rand("out", {ch.total, W});
  };
  c.forward = [=](Env& e) { sort_chunks(e("out"), e("in"), ch.first, ch.rows); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) { unsort_chunks(e("din"), e("dout"), ch.first, ch.rows); };
  c.grads = {{"in", "din", kOver}};
  c.bad_args = {{kFwd, "out", "sort_chunks"}, {kFwd, "in", "sort_chunks"}, {kBwd, "din", "unsort_chunks"}};
  return c;
}

inline OpCase unsort_chunks_case(const std::string& name, const int64_t C, const int64_t W) {
  const ChunkList ch = shuffled_chunks(C);
  const int64_t N = ch.total + 3;
  OpCase c{name, {"unsort_chunks", "sort_chunks"}};
  c.build = [=](Env& e) {
    e.rand("in", {ch.total, W});
    e.rand("out", {N, W});
  };
  c.forward = [=](Env& e) { unsort_chunks(e("out"), e("in"), ch.first, ch.rows); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) { sort_chunks(e("din"), e("dout"), ch.first, ch.rows); };
  c.grads = {{"in", "din", kOver}};
  c.bad_args = {{kFwd, "out", "unsort_chunks"}, {kFwd, "in", "unsort_chunks"}, {kBwd, "din", "sort_chunks"}};
  return c;
}

// The MLPs of E experts over their rows of one buffer (rows_E per expert, zero allowed): an activation, the
// probability after it or on the input, biases or not. An expert above 256 rows spans several of the fast kernel's
// tiles.
inline OpCase grouped_mlp_case(const std::string& name, const std::vector<int64_t>& rows_E, const int64_t H,
                               const int64_t F, const Activation activation, const bool probs_on_input,
                               const bool bias) {
  const auto E = static_cast<int64_t>(rows_E.size());
  std::vector<int64_t> offsets(1, 0);
  for (const int64_t rows : rows_E) offsets.push_back(offsets.back() + rows);
  const int64_t R = offsets.back(), F1 = activation_input_width(activation, F);
  const GroupedMlpSpec spec{activation, probs_on_input};
  const bool weighted = activation == Activation::kSwiGLU && !probs_on_input;
  auto name_of = [](const char* stem, const int64_t e) {
    std::string out = stem;
    out += std::to_string(e);
    return out;
  };
  auto grad_of = [](const char* stem, const int64_t e) {
    std::string out = "d";
    out += stem;
    out += std::to_string(e);
    return out;
  };
  // Per expert: fc1 weight w1_, fc2 weight w2_, biases b1_ / b2_ (and their gradients "d" + name).
  const std::vector<std::pair<const char*, std::vector<int64_t>>> params = {
      {"w1_", {F1, H}}, {"w2_", {H, F}}, {"b1_", {F1}}, {"b2_", {H}}};
  OpCase c{name, {"grouped_mlp_forward", "grouped_mlp_backward"}};
  c.build = [=](Env& e) {
    e.rand("x", {R, H});
    e.rand("probs", {R}, 1.0, true);
    for (int64_t x = 0; x < E; ++x) {
      for (const auto& [stem, shape] : params) {
        if (!bias && stem[0] == 'b') continue;
        e.rand(name_of(stem, x), shape, 0.5);
        // An expert without rows: its gradient buffers must stay as they are (no gradient to check).
        if (rows_E[static_cast<size_t>(x)] == 0) e.rand(grad_of(stem, x), shape);
      }
    }
    e.rand("y", {R, H});
    e.rand("fc1", {R, F1});
    e.rand(weighted ? "h" : "act", {R, F});
    if (probs_on_input) e.rand("xs", {R, H});
  };
  auto all = [=](Env& e, const std::string& prefix, const char* stem) {
    std::vector<Tensor*> out;
    for (int64_t x = 0; x < E && (bias || stem[0] != 'b'); ++x) out.push_back(&e(prefix + name_of(stem, x)));
    return out;
  };
  auto opt = [](Env& e, const char* tensor) { return e.has(tensor) ? &e(tensor) : nullptr; };
  auto with_params = [=](Env& e, auto&& fn) {
    const std::vector<Tensor*> w1 = all(e, "", "w1_"), b1 = all(e, "", "b1_"), w2 = all(e, "", "w2_"),
                               b2 = all(e, "", "b2_");
    const std::vector<const Tensor*> cw1(w1.begin(), w1.end()), cb1(b1.begin(), b1.end()), cw2(w2.begin(), w2.end()),
        cb2(b2.begin(), b2.end());
    fn(GroupedMlpParams{cw1, cb1, cw2, cb2});
  };
  c.forward = [=](Env& e) {
    with_params(e, [&](const GroupedMlpParams& p) {
      grouped_mlp_forward(e("y"), e("fc1"), opt(e, "act"), opt(e, "h"), opt(e, "xs"), e("x"), e("probs"), p, offsets,
                          spec);
    });
  };
  c.outputs = {"y", "fc1", weighted ? "h" : "act"};
  if (probs_on_input) c.outputs.push_back("xs");
  c.loss = {"y"};
  c.backward = [=](Env& e) {
    with_params(e, [&](const GroupedMlpParams& p) {
      grouped_mlp_backward(e("dx"), e("dprobs"),
                           {all(e, "d", "w1_"), all(e, "d", "b1_"), all(e, "d", "w2_"), all(e, "d", "b2_")}, e("dy"),
                           e("x"), opt(e, "xs"), e("fc1"), opt(e, "act"), opt(e, "h"), e("probs"), p, offsets, spec);
    });
  };
  c.grads = {{"x", "dx", kAcc}, {"probs", "dprobs", kOver}};
  for (int64_t x = 0; x < E; ++x) {
    if (rows_E[static_cast<size_t>(x)] == 0) continue;
    for (const auto& [stem, shape] : params) {
      if (bias || stem[0] != 'b') c.grads.push_back({name_of(stem, x), grad_of(stem, x), kAcc});
    }
  }
  c.bad_args = {{kFwd, "y", "grouped_mlp_forward"},
                {kFwd, "x", "grouped_mlp_forward"},
                {kFwd, "probs", "grouped_mlp_forward"},
                {kFwd, "fc1", "grouped_mlp_forward"},
                {kFwd, "w1_1", "grouped_mlp_forward"},
                {kFwd, "w2_0", "grouped_mlp_forward"},
                {kBwd, "dx", "grouped_mlp_backward"},
                {kBwd, "dprobs", "grouped_mlp_backward"},
                {kBwd, "dw1_0", "grouped_mlp_backward"},
                {kBwd, "dy", "grouped_mlp_backward"},
                {kFwd, weighted ? "h" : "act", "grouped_mlp_forward"}};
  if (probs_on_input) c.bad_args.push_back({kFwd, "xs", "grouped_mlp_forward"});
  if (bias) {
    c.bad_args.push_back({kFwd, "b1_0", "grouped_mlp_forward"});
    c.bad_args.push_back({kBwd, "db2_0", "grouped_mlp_backward"});
  }
  return c;
}

// T = S B token rows starting at one-process row row_offset (a sequence shard) over P positions.
inline OpCase position_embedding_case(const std::string& name, const int64_t T, const int64_t B, const int64_t H,
                                      const int64_t P, const int64_t row_offset) {
  OpCase c{name, {"add_position_embedding", "position_embedding_backward"}};
  c.build = [=](Env& e) {
    e.rand("x0", {T, H});
    e.rand("pos", {P, H});
    e.rand("x", {T, H});
  };
  c.forward = [=](Env& e) {
    reset(e("x"), e("x0"));
    add_position_embedding(e("x"), e("pos"), B, row_offset);
  };
  c.outputs = {"x"};
  c.loss = {"x"};
  c.backward = [=](Env& e) { position_embedding_backward(e("dpos"), e("dx"), B, row_offset); };
  c.grads = {{"pos", "dpos", kAcc}};
  c.bad_args = {{kFwd, "x", "add_position_embedding"}, {kBwd, "dx", "position_embedding_backward"}};
  return c;
}

// Narrowing to bf16 and fp16, bf16 -> fp16, and widening back to the environment's dtype (values 30..300, so fp16
// keeps them finite and normal). Both backends must agree bit for bit; OpsConvert checks the values themselves.
inline OpCase convert_case(const std::string& name, const std::vector<int64_t>& shape) {
  OpCase c{name, {"convert"}};
  c.build = [=](Env& e) {
    e.rand("src", shape, 300.0);
    e.rand("bf16", shape, 1.0, false, DType::kBF16);
    e.rand("fp16", shape, 1.0, false, DType::kF16);
    e.rand("fp16_from_bf16", shape, 1.0, false, DType::kF16);
    e.rand("back", shape);
  };
  c.forward = [](Env& e) {
    convert(e("bf16"), e("src"));
    convert(e("fp16"), e("src"));
    convert(e("fp16_from_bf16"), e("bf16"));
    convert(e("back"), e("fp16"));
  };
  c.outputs = {"bf16", "fp16", "fp16_from_bf16", "back"};
  return c;
}

// A shard's runs of the one-process tensor's counter-RNG normal draws (runs out of order, as a sharded dimension
// gives them).
inline OpCase normal_fill_case(const std::string& name, const std::vector<int64_t>& first_R, const int64_t run) {
  OpCase c{name, {"normal_fill"}};
  c.build = [=](Env& e) { e.rand("param", {static_cast<int64_t>(first_R.size()), run}); };
  c.forward = [=](Env& e) { normal_fill(e("param"), first_R, run, 1234, 99, 0.02); };
  c.outputs = {"param"};
  return c;
}

// ---- routing (ops/routing.h) ------------------------------------------------------------------------------------

// Scores in the tensor's precision (fp32_scores off), so finite differences in fp64 see a smooth function.
inline TopkRoutingSpec routing_spec(const RoutingScore score, const bool pre_softmax = false) {
  TopkRoutingSpec spec;
  spec.score = score;
  spec.pre_softmax = pre_softmax;
  spec.fp32_scores = false;
  return spec;
}

// An integer tensor of `shape` filled with value_of(i).
template <typename I>
inline Tensor int_tensor(const std::vector<int64_t>& shape, const std::function<int64_t(int64_t)>& value_of) {
  Tensor t(shape, dtype_of<I>());
  for (int64_t i = 0; i < t.numel(); ++i) t.data<I>()[i] = static_cast<I>(value_of(i));
  return t;
}

// The router's chain: top-k routing, then the routing map (capacity < 0: none), backward through both.
struct RoutingCaseOptions {
  bool bias = false, select = false;
  int64_t capacity = -1;
  RoutingDropPolicy policy = RoutingDropPolicy::kProbs;
  bool pad = false;
};
inline OpCase topk_routing_case(const std::string& name, const int64_t n, const int64_t E, const int64_t k,
                                const TopkRoutingSpec& spec, const RoutingCaseOptions& o = {}) {
  OpCase c{name, {"topk_routing_forward", "routing_map", "topk_routing_backward"}};
  c.build = [=](Env& e) {
    e.rand("logits", {n, E}, 2.0);
    if (o.bias) e.rand("bias", {E}, 0.3, false, DType::kF32);
    if (o.select) e.rand("select", {n, E}, 1.0, true);
    e.put("idx", int_tensor<int32_t>({n, k}, [](int64_t) { return 0; }));
    e.rand("probs", {n, k});
    e.put("map", int_tensor<uint8_t>({n, E}, [](int64_t i) { return i % 2; }));
    e.rand("probs_TE", {n, E});
    e.put("counts", int_tensor<int64_t>({E}, [](int64_t i) { return i + 3; }));
  };
  c.forward = [=](Env& e) {
    topk_routing_forward(e("idx"), e("probs"), e("logits"), o.bias ? &e("bias") : nullptr,
                         o.select ? &e("select") : nullptr, spec);
    routing_map(e("map"), e("probs_TE"), e("counts"), e("idx"), e("probs"), o.capacity, o.policy, o.pad);
  };
  c.outputs = {"idx", "probs", "map", "probs_TE", "counts"};
  c.loss = {"probs_TE"};
  c.backward = [=](Env& e) {
    topk_routing_backward(e("dlogits"), e("dprobs_TE"), &e("map"), e("idx"), e("logits"), spec);
  };
  c.grads = {{"logits", "dlogits", kAcc}};
  c.bad_args = {{kFwd, "logits", "topk_routing_forward"},
                {kFwd, "idx", "topk_routing_forward"},
                {kFwd, "probs", "topk_routing_forward"},
                {kFwd, "probs_TE", "routing_map"},
                {kFwd, "map", "routing_map"},
                {kFwd, "counts", "routing_map"},
                {kBwd, "dlogits", "topk_routing_backward"},
                {kBwd, "dprobs_TE", "topk_routing_backward"}};
  if (o.bias) c.bad_args.push_back({kFwd, "bias", "topk_routing_forward"});
  return c;
}

inline OpCase sinkhorn_case(const std::string& name, const int64_t n, const int64_t E) {
  OpCase c{name, {"sinkhorn"}};
  c.build = [=](Env& e) {
    e.rand("logits", {n, E}, 2.0);
    e.rand("out", {n, E});
  };
  c.forward = [](Env& e) { sinkhorn(e("out"), e("logits")); };
  c.outputs = {"out"};
  c.bad_args = {{kFwd, "out", "sinkhorn"}, {kFwd, "logits", "sinkhorn"}};
  return c;
}

inline OpCase aux_scores_case(const std::string& name, const int64_t n, const int64_t E, const int64_t k,
                              const RoutingScore score) {
  OpCase c{name, {"aux_scores_forward", "aux_scores_backward"}};
  c.build = [=](Env& e) {
    e.rand("logits", {n, E}, 2.0);
    e.rand("scores", {n, E});
    e.put("idx", int_tensor<int32_t>({n, k}, [](int64_t) { return 0; }));
  };
  c.forward = [=](Env& e) { aux_scores_forward(e("scores"), e("idx"), e("logits"), score, false); };
  c.outputs = {"scores", "idx"};
  c.loss = {"scores"};
  c.backward = [=](Env& e) { aux_scores_backward(e("dlogits"), e("dscores"), e("scores"), e("logits"), score); };
  c.grads = {{"logits", "dlogits", kAcc}};
  c.bad_args = {{kFwd, "scores", "aux_scores_forward"},
                {kFwd, "idx", "aux_scores_forward"},
                {kBwd, "dlogits", "aux_scores_backward"},
                {kBwd, "dscores", "aux_scores_backward"}};
  return c;
}

inline OpCase aux_loss_sums_case(const std::string& name, const int64_t n, const int64_t B, const int64_t E,
                                 const int64_t k) {
  OpCase c{name, {"aux_loss_sums"}};
  c.build = [=](Env& e) {
    e.rand("scores", {n, E}, 1.0, true);
    e.put("idx", int_tensor<int32_t>({n, k}, [=](const int64_t i) { return ((i / k) * 3 + i % k) % E; }));
    e.rand("sums_E", {E});
    e.rand("sums_BE", {B, E});
    e.rand("counts_BE", {B, E});
  };
  c.forward = [=](Env& e) { aux_loss_sums(e("sums_E"), e("sums_BE"), e("counts_BE"), e("scores"), e("idx"), B); };
  c.outputs = {"sums_E", "sums_BE", "counts_BE"};
  c.bad_args = {
      {kFwd, "sums_E", "aux_loss_sums"}, {kFwd, "counts_BE", "aux_loss_sums"}, {kFwd, "scores", "aux_loss_sums"}};
  return c;
}

inline OpCase switch_loss_case(const std::string& name, const int64_t J) {
  const SwitchLossSpec spec{.total_tokens = 12.0, .topk = 2, .num_experts = 5, .coeff = 0.3};
  OpCase c{name, {"switch_loss", "switch_loss_backward"}};
  c.build = [=](Env& e) {
    e.rand("sums", {J}, 1.0, true);
    e.rand("counts", {J}, 4.0, true);
    e.rand("loss", {1});
  };
  c.forward = [=](Env& e) { set(e("loss"), 0, switch_loss(e("sums"), e("counts"), spec)); };
  c.outputs = {"loss"};
  c.loss = {"loss"};
  c.backward = [=](Env& e) { switch_loss_backward(e("dsums"), e("counts"), spec, get(e("dloss"), 0)); };
  c.grads = {{"sums", "dsums", kAcc}};
  c.bad_args = {{kFwd, "counts", "switch_loss"}, {kBwd, "dsums", "switch_loss_backward"}};
  return c;
}

inline OpCase z_loss_case(const std::string& name, const int64_t n, const int64_t E) {
  constexpr double coeff = 0.7;
  OpCase c{name, {"z_loss_forward", "z_loss_backward"}};
  c.build = [=](Env& e) {
    e.rand("logits", {n, E}, 2.0);
    e.rand("lse", {n});
    e.rand("z", {1});
  };
  c.forward = [=](Env& e) { set(e("z"), 0, z_loss_forward(e("lse"), e("logits"), coeff)); };
  c.outputs = {"lse", "z"};
  c.loss = {"z"};
  c.backward = [=](Env& e) { z_loss_backward(e("dlogits"), e("logits"), e("lse"), coeff * get(e("dz"), 0)); };
  c.grads = {{"logits", "dlogits", kAcc}};
  c.bad_args = {{kFwd, "lse", "z_loss_forward"}, {kBwd, "dlogits", "z_loss_backward"}};
  return c;
}

// The expert bias is fp32 whatever the counts' dtype.
inline OpCase expert_bias_update_case(const std::string& name, const int64_t E) {
  OpCase c{name, {"expert_bias_update"}};
  c.build = [=](Env& e) {
    e.rand("bias0", {E}, 0.1, false, DType::kF32);
    e.rand("bias", {E}, 0.1, false, DType::kF32);
    e.put("counts", Tensor({E}, e.dtype()));
    for (int64_t i = 0; i < E; ++i) set(e("counts"), i, static_cast<double>((i * 7) % 5));
  };
  c.forward = [](Env& e) {
    reset(e("bias"), e("bias0"));
    expert_bias_update(e("bias"), e("counts"), 1e-3);
  };
  c.outputs = {"bias"};
  c.bad_args = {{kFwd, "bias", "expert_bias_update"}};
  return c;
}

// ---- router input jitter and routing-map padding (ops/input_jitter.h, ops/routing_padding.h) -------------------

// Rows whose counters are out of order (a context-parallel shard's two chunks of the one-process rows).
inline std::vector<int64_t> shard_counters(const int64_t R, const int64_t run) {
  std::vector<int64_t> first_R;
  for (int64_t r = 0; r < R; ++r) first_R.push_back((r < R / 2 ? 3 * R + r : r) * run);
  return first_R;
}

inline OpCase input_jitter_case(const std::string& name, const int64_t R, const int64_t run) {
  const InputJitterSpec spec{0.3, 1234, 55};
  const std::vector<int64_t> first_R = shard_counters(R, run);
  OpCase c{name, {"input_jitter_forward", "input_jitter_backward"}};
  c.build = [=](Env& e) {
    e.rand("inp", {R, run});
    e.rand("out", {R, run});
  };
  c.forward = [=](Env& e) { input_jitter_forward(e("out"), e("inp"), first_R, run, spec); };
  c.outputs = {"out"};
  c.loss = {"out"};
  c.backward = [=](Env& e) { input_jitter_backward(e("dinp"), e("dout"), first_R, run, spec); };
  c.grads = {{"inp", "dinp", kAcc}};
  c.bad_args = {{kFwd, "out", "input_jitter_forward"},
                {kFwd, "inp", "input_jitter_forward"},
                {kBwd, "dinp", "input_jitter_backward"}};
  return c;
}

// A sparse map (about one entry in five set): most experts need padding; with a multiple past the unrouted tokens
// some stay short.
inline OpCase pad_routing_map_case(const std::string& name, const int64_t T, const int64_t E, const int64_t multiple) {
  OpCase c{name, {"pad_routing_map"}};
  c.build = [=](Env& e) {
    e.put("map", int_tensor<uint8_t>({T, E}, [](int64_t i) { return (i * 7 + i / 3) % 5 == 0 ? 1 : 0; }));
    e.put("counts", int_tensor<int64_t>({E}, [](int64_t i) { return i + 3; }));
  };
  c.forward = [=](Env& e) { pad_routing_map(e("map"), e("counts"), multiple); };
  c.outputs = {"map", "counts"};
  c.bad_args = {{kFwd, "map", "pad_routing_map"}, {kFwd, "counts", "pad_routing_map"}};
  return c;
}

// ---- the dispatchers' expert-major rows (ops/expert_rows.h) -------------------------------------------------------

// Experts [e_begin, e_begin + X) of a sparse [T, E] map (about one entry in five set; some experts get none). With
// a capacity, every expert reports `capacity` rows (at least its routed count), so most end in padding rows.
inline OpCase expert_major_rows_case(const std::string& name, const int64_t T, const int64_t E, const int64_t e_begin,
                                     const int64_t X, const int64_t capacity) {
  const auto routed = [E](const int64_t i) { return (i * 7 + i / 3) % 5 == 0 && i % E % 4 != 1 ? 1 : 0; };
  std::vector<int64_t> rows_X(static_cast<size_t>(X), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t x = 0; x < X; ++x) rows_X[static_cast<size_t>(x)] += routed(t * E + e_begin + x);
  }
  if (capacity >= 0) std::fill(rows_X.begin(), rows_X.end(), capacity);
  const int64_t R = std::accumulate(rows_X.begin(), rows_X.end(), int64_t{0});
  OpCase c{name, {"expert_major_rows"}};
  c.build = [=](Env& e) {
    e.put("map", int_tensor<uint8_t>({T, E}, routed));
    e.rand("probs", {T, E}, 1.0, true);
    e.put("token", int_tensor<int64_t>({R}, [](int64_t i) { return 1000 + i; }));
    e.rand("probs_R", {R});
  };
  c.forward = [=](Env& e) {
    expert_major_rows(e("token"), e("probs_R"), e("map"), e("probs"), e_begin, rows_X, capacity);
  };
  c.outputs = {"token", "probs_R"};
  c.bad_args = {{kFwd, "map", "expert_major_rows"},
                {kFwd, "probs", "expert_major_rows"},
                {kFwd, "token", "expert_major_rows"},
                {kFwd, "probs_R", "expert_major_rows"}};
  return c;
}

// Small shapes (T = 5..12 rows, odd widths) for every op, then "_large" shapes just past the fast kernels' OpenMP
// thresholds (and two 64-row attention blocks), so the 2-thread runs take the parallel paths.
inline const std::vector<OpCase>& all_cases() {
  static const std::vector<OpCase> cases = [] {
    DropoutSpec no_dropout;
    DropoutSpec attn_dropout = test_dropout();
    attn_dropout.offset = 0;
    // Heads [2, 4) of 4 (one of two tensor-parallel ranks): dropout counters use the global head index.
    AttentionDims tp_shard = attention_dims(6, 2, 2, 1);
    tp_shard.dropout_total_heads = 4;
    tp_shard.dropout_head_offset = 2;
    return std::vector<OpCase>{
        linear_case("linear_bias", {2, 3, 7}, 9, true, true),
        linear_case("linear_no_bias", {5, 6}, 3, false, true),
        linear_case("linear_input_grad_only", {11, 4}, 5, false, false),
        rmsnorm_case("rmsnorm", 7, 11),
        layernorm_case("layernorm_bias", {2, 5, 9}, true),
        layernorm_case("layernorm_no_bias", {6, 10}, false),
        rope_case("rope_full", {5, 2, 3, 8, 8, 10000.0, 3}),
        rope_case("rope_partial", {5, 2, 3, 8, 4, 500.0, 0}),
        attention_case("attention_gqa", attention_dims(6, 2, 4, 2), no_dropout),
        attention_case("attention_gqa_dropout", attention_dims(6, 2, 4, 2), attn_dropout),
        attention_case("attention_tp_shard_dropout", tp_shard, attn_dropout),
        attention_case("attention_documents", attention_dims(9, 2, 4, 2), no_dropout, packed_documents(9, 2, {3, 5})),
        attention_case("attention_documents_dropout", attention_dims(9, 2, 4, 2), attn_dropout,
                       packed_documents(9, 2, {2, 7})),
        // Rank 1 of cp 2 (chunks of 3 rows) against rank 0's keys: every query row sees some key.
        attention_case("attention_cp_block_dropout", attention_dims(6, 2, 4, 2), attn_dropout,
                       cp_block(2, 1, 0, 3, 2, {})),
        // Rank 0 against rank 1's keys, with documents: some query rows see no key (out 0, lse -inf).
        attention_case("attention_cp_block_documents", attention_dims(6, 2, 4, 2), attn_dropout,
                       cp_block(2, 0, 1, 3, 2, {4, 10})),
        attention_merge_case("attention_merge", attention_dims(5, 2, 3, 3)),
        attention_ring_case("attention_ring_two_blocks", attention_dims(6, 2, 4, 2), attn_dropout,
                            cp_block(2, 0, 0, 3, 2, {5}), cp_block(2, 0, 1, 3, 2, {5})),
        // Value heads narrower (5) and wider (11) than the 8-wide query / key heads (multi-latent attention).
        attention_case("attention_value_heads", attention_dims(6, 2, 4, 2, 5), no_dropout),
        attention_case("attention_wide_value_heads_dropout", attention_dims(7, 2, 4, 1, 11), attn_dropout),
        attention_case("attention_value_heads_cp_block_documents", attention_dims(6, 2, 4, 2, 3), attn_dropout,
                       cp_block(2, 0, 1, 3, 2, {4, 10})),
        attention_merge_case("attention_merge_value_heads", attention_dims(5, 2, 3, 3, 4)),
        attention_ring_case("attention_ring_value_heads", attention_dims(6, 2, 4, 2, 5), attn_dropout,
                            cp_block(2, 0, 0, 3, 2, {5}), cp_block(2, 0, 1, 3, 2, {5})),
        rope_positions_case("rope_document_positions", {6, 2, 3, 8, 6, 10000.0, 0}, document_positions(6, 2, 4)),
        rope_positions_case("rope_cp_positions", {6, 2, 3, 8, 8, 10000.0, 0}, repeat_per_batch(cp_rows(3, 1, 3), 2)),
        rope_spec_case("rope_mla_yarn", 6, 2, 3, mla_yarn_spec(8, 8, true), document_positions(6, 2, 6)),
        rope_spec_case("rope_mla_partial", 5, 2, 2, mla_yarn_spec(10, 6, true), document_positions(5, 2, 3)),
        rope_spec_case("rope_yarn_halves", 6, 1, 3, mla_yarn_spec(8, 8, false), document_positions(6, 1, 6)),
        activation_case("gelu", Activation::kGelu, 7, 5),
        activation_case("swiglu", Activation::kSwiGLU, 7, 5),
        activation_case("squared_relu", Activation::kSquaredReLU, 7, 5),
        weighted_swiglu_case("weighted_swiglu", 7, 5),
        dropout_case("dropout", {9, 7}),
        cross_entropy_case("cross_entropy", 8, 13),
        vocab_ce_case(),
        linear_cross_entropy_case("linear_cross_entropy", 13, -1, 13, {0, 12, 5, 7, 3, 12, 9, 1}),
        linear_cross_entropy_case("linear_cross_entropy_vocab_parallel", 20, 7, 6, {7, 0, 12, 19, 9, 6, 13, 10}),
        embedding_case("embedding_vocab_parallel", 20, 6, 7, {6, 0, 12, 8, 19, 6, 13, 5, 9}),
        embedding_case("embedding_whole_vocab", 11, 0, 11, {3, 10, 0, 3, 7, 1, 10}),
        add_case("add", {6, 5}),
        scale_case("scale", {6, 5}),
        adamw_case("adamw_step", {4, 7}),
        split_qkv_case("split_qkv", {5, 4, 2, 3}),
        merge_qkv_case("merge_qkv", {5, 4, 2, 3}),
        copy_columns_case("copy_columns", 7, 5, 3),
        add_bias_rows_case("add_bias_rows", 6, 7),
        scale_rows_case("scale_rows", 8, 5),
        add_outer_case("add_outer", 8, 5),
        row_dot_case("row_dot", 8, 5),
        sigmoid_case("sigmoid", {8, 5}),
        gather_rows_case("gather_rows", 6, 9, 4),
        scatter_add_rows_case("scatter_add_rows", 6, 9, 4),
        moe_permute_case("moe_permute", 6, 9, 4),
        moe_unpermute_case("moe_unpermute", 6, 9, 4, false),
        moe_unpermute_case("moe_unpermute_probs", 6, 9, 4, true),
        sort_chunks_case("sort_chunks", 9, 4),
        unsort_chunks_case("unsort_chunks", 9, 4),
        grouped_mlp_case("grouped_mlp_weighted_swiglu", {3, 0, 5, 1}, 6, 4, Activation::kSwiGLU, false, false),
        grouped_mlp_case("grouped_mlp_gelu_bias", {2, 4, 0}, 5, 7, Activation::kGelu, false, true),
        grouped_mlp_case("grouped_mlp_swiglu_bias_probs_on_input", {0, 3, 2}, 6, 4, Activation::kSwiGLU, true, true),
        grouped_mlp_case("grouped_mlp_squared_relu_probs_on_input", {4, 1, 0}, 5, 3, Activation::kSquaredReLU, true,
                         false),
        normal_fill_case("normal_fill", {40, 0, 90, 10}, 7),
        position_embedding_case("position_embedding", 10, 2, 6, 8, 4),
        convert_case("convert", {6, 5}),
        topk_routing_case("topk_routing_softmax", 7, 6, 2, routing_spec(RoutingScore::kSoftmax)),
        topk_routing_case("topk_routing_pre_softmax_capacity", 9, 5, 2, routing_spec(RoutingScore::kSoftmax, true),
                          {.capacity = 3}),
        topk_routing_case("topk_routing_sigmoid_groups_bias_pad", 8, 8, 3,
                          [] {
                            TopkRoutingSpec spec = routing_spec(RoutingScore::kSigmoid);
                            spec.num_groups = 4;
                            spec.group_topk = 2;
                            spec.scaling_factor = 2.5;
                            return spec;
                          }(),
                          {.bias = true, .capacity = 4, .policy = RoutingDropPolicy::kPosition, .pad = true}),
        topk_routing_case("topk_routing_sqrtsoftplus_top1", 6, 5, 1, routing_spec(RoutingScore::kSqrtSoftplus),
                          {.capacity = 2, .policy = RoutingDropPolicy::kPosition}),
        topk_routing_case("topk_routing_sinkhorn_top1", 7, 4, 1,
                          [] {
                            TopkRoutingSpec spec = routing_spec(RoutingScore::kSoftmax);
                            spec.sinkhorn = true;
                            return spec;
                          }(),
                          {.select = true}),
        topk_routing_case("topk_routing_sinkhorn_top2", 7, 5, 2,
                          [] {
                            TopkRoutingSpec spec = routing_spec(RoutingScore::kSoftmax);
                            spec.sinkhorn = true;
                            return spec;
                          }(),
                          {.select = true}),
        sinkhorn_case("sinkhorn", 9, 4),
        aux_scores_case("aux_scores_softmax", 7, 6, 2, RoutingScore::kSoftmax),
        aux_scores_case("aux_scores_sigmoid", 7, 6, 2, RoutingScore::kSigmoid),
        aux_scores_case("aux_scores_sqrtsoftplus", 6, 5, 3, RoutingScore::kSqrtSoftplus),
        aux_loss_sums_case("aux_loss_sums", 8, 2, 5, 2),
        switch_loss_case("switch_loss", 10),
        z_loss_case("z_loss", 7, 5),
        expert_bias_update_case("expert_bias_update", 6),
        input_jitter_case("input_jitter", 6, 7),
        pad_routing_map_case("pad_routing_map", 9, 6, 4),
        pad_routing_map_case("pad_routing_map_short_columns", 7, 5, 16),
        expert_major_rows_case("expert_major_rows", 9, 6, 0, 6, -1),
        expert_major_rows_case("expert_major_rows_local_experts", 12, 21, 2, 17, -1),
        expert_major_rows_case("expert_major_rows_padded_to_capacity", 12, 21, 5, 11, 6),

        linear_case("linear_large", {130, 8}, 131, true, true),
        rmsnorm_case("rmsnorm_large", 64, 257),
        layernorm_case("layernorm_large", {64, 257}, true),
        rope_case("rope_large", {40, 2, 4, 64, 32, 10000.0, 7}),
        attention_case("attention_large_mqa_dropout", attention_dims(70, 2, 4, 1), attn_dropout),
        attention_case("attention_large_cp_documents_dropout", attention_dims(70, 2, 4, 1), attn_dropout,
                       cp_block(2, 0, 0, 35, 2, {20, 50, 110})),
        attention_ring_case("attention_large_ring", attention_dims(70, 2, 4, 2), attn_dropout,
                            cp_block(2, 1, 1, 35, 2, {60}), cp_block(2, 1, 0, 35, 2, {60})),
        attention_merge_case("attention_merge_large", attention_dims(70, 2, 4, 64)),
        attention_case("attention_large_value_heads_dropout", attention_dims(70, 2, 4, 2, 4), attn_dropout,
                       cp_block(2, 1, 0, 35, 2, {30})),
        rope_positions_case("rope_large_positions", {40, 2, 4, 64, 32, 10000.0, 0}, document_positions(40, 2, 13)),
        rope_spec_case("rope_mla_large", 40, 2, 4, mla_yarn_spec(64, 64, true), document_positions(40, 2, 40)),
        activation_case("gelu_large", Activation::kGelu, 33, 1025),
        activation_case("swiglu_large", Activation::kSwiGLU, 33, 1025),
        activation_case("squared_relu_large", Activation::kSquaredReLU, 33, 1025),
        weighted_swiglu_case("weighted_swiglu_large", 33, 1025),
        dropout_case("dropout_large", {97, 91}),
        cross_entropy_case("cross_entropy_large", 40, 1031),
        add_case("add_large", {257, 257}),
        scale_case("scale_large", {257, 257}),
        adamw_case("adamw_step_large", {257, 257}),
        split_qkv_case("split_qkv_large", {70, 8, 2, 24}),
        merge_qkv_case("merge_qkv_large", {70, 8, 2, 24}),
        add_bias_rows_case("add_bias_rows_large", 131, 129),
        scale_rows_case("scale_rows_large", 130, 129),
        add_outer_case("add_outer_large", 130, 129),
        row_dot_case("row_dot_large", 130, 129),
        sigmoid_case("sigmoid_large", {130, 129}),
        gather_rows_case("gather_rows_large", 128, 300, 64),
        scatter_add_rows_case("scatter_add_rows_large", 128, 300, 64),
        moe_permute_case("moe_permute_large", 128, 300, 64),
        moe_unpermute_case("moe_unpermute_probs_large", 128, 300, 64, true),
        sort_chunks_case("sort_chunks_large", 96, 129),
        unsort_chunks_case("unsort_chunks_large", 96, 129),
        grouped_mlp_case("grouped_mlp_weighted_swiglu_bias_large", {300, 10, 0, 530}, 33, 17, Activation::kSwiGLU,
                         false, true),
        grouped_mlp_case("grouped_mlp_gelu_probs_on_input_large", {0, 260, 7}, 20, 9, Activation::kGelu, true, true),
        normal_fill_case("normal_fill_large", {0, 40000, 20000}, 9000),
        position_embedding_case("position_embedding_large", 260, 4, 65, 80, 12),
        convert_case("convert_large", {300, 257}),
        topk_routing_case("topk_routing_large", 130, 130, 4, routing_spec(RoutingScore::kSigmoid),
                          {.bias = true, .capacity = 5}),
        aux_scores_case("aux_scores_large", 130, 130, 4, RoutingScore::kSoftmax),
        z_loss_case("z_loss_large", 130, 130),
        input_jitter_case("input_jitter_large", 130, 97),
        pad_routing_map_case("pad_routing_map_large", 300, 260, 16),
        expert_major_rows_case("expert_major_rows_large", 300, 260, 64, 128, 110),
    };
  }();
  return cases;
}

// ---- low-precision cases ----------------------------------------------------------------------------------------

// For each output or gradient of a low-precision case, per element: how many terms the op sums into it and the sum of
// their absolute values, computed in double from the tensors before the op runs. OpsLowPrecision derives each
// element's tolerance from them and from the output's format.
struct AbsSum {
  int64_t terms = 0;
  std::vector<double> values;
};

// An op on bf16 / fp16 tensors (Megatron's --bf16 / --fp16): build() makes every tensor, including the output
// gradients "d" + output and the gradient buffers, in the dtype the case gives it.
struct LowpCase {
  std::string name;
  DType low;
  std::function<void(Env&)> build, forward, backward;
  std::vector<std::string> outputs, grads;
  std::function<std::map<std::string, AbsSum>(Env&)> abs_sums;
};

// Which tensors of a low-precision linear case are fp32 (the others are in the low dtype).
struct LinearFp32 {
  bool out = false, bias = false, dinp = false, dweight = false, dbias = false;
};

inline LowpCase lowp_linear_case(const std::string& name, const DType low, const std::vector<int64_t>& inp_shape,
                                 const int64_t O, const bool bias, const bool weight_grad, const LinearFp32 fp32) {
  const int64_t I = inp_shape.back();
  int64_t T = 1;
  for (size_t i = 0; i + 1 < inp_shape.size(); ++i) T *= inp_shape[i];
  std::vector<int64_t> out_shape = inp_shape;
  out_shape.back() = O;
  const auto dtype = [low](const bool is_fp32) { return is_fp32 ? DType::kF32 : low; };
  LowpCase c;
  c.name = name;
  c.low = low;
  c.build = [=](Env& e) {
    e.rand("inp", inp_shape);
    e.rand("weight", {O, I});
    if (bias) e.rand("bias", {O}, 1.0, false, dtype(fp32.bias));
    e.rand("out", out_shape, 1.0, false, dtype(fp32.out));
    e.rand("dout", out_shape);
    e.rand("dinp", inp_shape, 1.0, false, dtype(fp32.dinp));
    if (weight_grad) e.rand("dweight", {O, I}, 1.0, false, dtype(fp32.dweight));
    if (bias) e.rand("dbias", {O}, 1.0, false, dtype(fp32.dbias));
  };
  c.forward = [=](Env& e) { linear_forward(e("out"), e("inp"), e("weight"), bias ? &e("bias") : nullptr); };
  c.backward = [=](Env& e) {
    linear_backward(&e("dinp"), weight_grad ? &e("dweight") : nullptr, bias ? &e("dbias") : nullptr, e("dout"),
                    weight_grad ? &e("inp") : nullptr, e("weight"));
  };
  c.outputs = {"out"};
  c.grads = {"dinp"};
  if (weight_grad) c.grads.push_back("dweight");
  if (bias) c.grads.push_back("dbias");
  c.abs_sums = [=](Env& e) {
    const auto at = [&e](const std::string& t, const int64_t i) { return std::abs(get(e(t), i)); };
    std::map<std::string, AbsSum> sums;
    AbsSum& out = sums["out"];
    out.terms = I + (bias ? 1 : 0);
    AbsSum& dinp = sums["dinp"];
    dinp.terms = O + 1;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t o = 0; o < O; ++o) {
        double sum = bias ? at("bias", o) : 0.0;
        for (int64_t i = 0; i < I; ++i) sum += at("inp", t * I + i) * at("weight", o * I + i);
        out.values.push_back(sum);
      }
      for (int64_t i = 0; i < I; ++i) {
        double sum = at("dinp", t * I + i);
        for (int64_t o = 0; o < O; ++o) sum += at("dout", t * O + o) * at("weight", o * I + i);
        dinp.values.push_back(sum);
      }
    }
    if (weight_grad) {
      AbsSum& dweight = sums["dweight"];
      dweight.terms = T + 1;
      for (int64_t o = 0; o < O; ++o) {
        for (int64_t i = 0; i < I; ++i) {
          double sum = at("dweight", o * I + i);
          for (int64_t t = 0; t < T; ++t) sum += at("dout", t * O + o) * at("inp", t * I + i);
          dweight.values.push_back(sum);
        }
      }
    }
    if (bias) {
      AbsSum& dbias = sums["dbias"];
      dbias.terms = T + 1;
      for (int64_t o = 0; o < O; ++o) {
        double sum = at("dbias", o);
        for (int64_t t = 0; t < T; ++t) sum += at("dout", t * O + o);
        dbias.values.push_back(sum);
      }
    }
    return sums;
  };
  return c;
}

// Each low dtype with: low outputs and fp32 main gradients (Megatron's --bf16 with gradient_accumulation_fusion),
// fp32 outputs and low gradients, everything low, the input gradient alone, and a "_large" shape past the OpenMP
// thresholds.
inline const std::vector<LowpCase>& lowp_cases() {
  static const std::vector<LowpCase> cases = [] {
    std::vector<LowpCase> out;
    for (const DType low : {DType::kBF16, DType::kF16}) {
      const std::string prefix = "linear_" + std::string(low == DType::kBF16 ? "bf16" : "fp16");
      const LinearFp32 main_grads{.dweight = true, .dbias = true};
      const LinearFp32 fp32_outputs{.out = true, .bias = true, .dinp = true};
      out.push_back(lowp_linear_case(prefix + "_main_grads", low, {2, 3, 7}, 9, true, true, main_grads));
      out.push_back(lowp_linear_case(prefix + "_fp32_outputs", low, {5, 6}, 3, true, true, fp32_outputs));
      out.push_back(lowp_linear_case(prefix + "_all_low", low, {4, 10}, 6, true, true, {}));
      out.push_back(lowp_linear_case(prefix + "_input_grad_only", low, {11, 4}, 5, false, false, {}));
      out.push_back(lowp_linear_case(prefix + "_large", low, {130, 8}, 131, true, true, main_grads));
    }
    return out;
  }();
  return cases;
}

}  // namespace moecore::ops::test
