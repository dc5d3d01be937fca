// 16-bit activations (ops/precision.h): every case of the op table, run on inputs that are 16-bit values, under
// ScopedActivationDType(bf16 / fp16) against the same case run in plain fp32. Each tensor an op writes must come out
// either exactly the fp32 result rounded to the 16-bit dtype (activations and activation gradients) or exactly the
// fp32 result (statistics, losses, weight and bias gradients, optimizer state), as the header lists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>

#include "moecore/kernels/cpu/attention_products.h"
#include "moecore/kernels/cpu/gemm_lowp.h"
#include "moecore/ops/ops.h"
#include "moecore/ops/precision.h"
#include "unit/ops_test_cases.h"

namespace moecore::ops {
namespace {

using test::Env;
using test::OpCase;

// Written tensors that stay fp32 under a 16-bit activation dtype.
const std::set<std::string> kFp32Outputs = {"lse",   "plse",  "rstd",    "mean",       "losses",  "max",
                                            "stats", "param", "exp_avg", "exp_avg_sq", "dweight", "dbias",
                                            "db",    "dw",    "ds",      "dprobs",     "dpos"};

// The router's ops (ops/routing.h): Megatron's router computes in fp32 (or --moe-router-dtype) whatever the
// activation dtype, so everything they write stays fp32.
const std::set<std::string> kRouterOps = {
    "topk_routing_forward", "topk_routing_backward", "routing_map",     "sinkhorn",
    "aux_scores_forward",   "aux_scores_backward",   "aux_loss_sums",   "switch_loss",
    "switch_loss_backward", "z_loss_forward",        "z_loss_backward", "expert_bias_update"};

float round_to(const float value, const DType dtype) {
  return dtype == DType::kBF16 ? bf16_to_fp32(fp32_to_bf16(value)) : fp16_to_fp32(fp32_to_fp16(value));
}

Env inputs_in(const OpCase& c, const DType dtype) {
  Env env = test::make_env(c, DType::kF32);
  std::vector<std::string> names;
  for (const auto& [name, t] : env.tensors()) names.push_back(name);
  for (const std::string& name : names) round_to_dtype_(env(name), dtype);
  return env;
}

// Every written tensor of `scoped` against `plain`: rounded, or (kFp32Outputs, or every tensor of a router op)
// equal. Counts rounded tensors.
void expect_rounded_or_kept(const std::string& what, Env& plain, Env& scoped, const DType dtype, const bool router,
                            int& rounded) {
  for (const auto& [name, want] : plain.tensors()) {
    const Tensor& got = scoped(name);
    // Per-expert tensors carry the expert's number ("dw0"): classified by their stem.
    const bool fp32 = router || kFp32Outputs.count(name.substr(0, name.find_last_not_of("0123456789") + 1)) != 0;
    bool changed = false;
    for (int64_t i = 0; i < want.numel(); ++i) {
      const float w = want.data<float>()[i];
      const float expected = fp32 ? w : round_to(w, dtype);
      changed = changed || expected != w;
      ASSERT_EQ(got.data<float>()[i], expected) << what << ": " << name << "[" << i << "] under " << dtype_name(dtype)
                                                << (fp32 ? " (stays fp32)" : " (rounded)");
    }
    rounded += changed ? 1 : 0;
  }
}

// dst's tensors := src's values (deep copy, same shapes).
void copy_values(Env& dst, const Env& src) {
  for (const auto& [name, t] : src.tensors()) std::copy_n(t.data<float>(), t.numel(), dst(name).data<float>());
}

class OpsPrecision : public ::testing::TestWithParam<DType> {};

TEST_P(OpsPrecision, ActivationsRoundAndStatisticsStayFp32) {
  const DType dtype = GetParam();
  // The convert path is the plain fp32 GEMM on the 16-bit values, so the scoped linear layers match the fp32 run
  // bit for bit; the native path sums in another order (LinearNativePathMatchesTheReference below).
  const kernels::cpu::ScopedLowpGemmPath convert(kernels::cpu::LowpGemmPath::kConvert);
  // Likewise the attention's fp32 products: its bf16 products round P and dS as well (a deliberate numerics change,
  // checked against the reference in kernels_attention_bf16_test).
  const kernels::cpu::ScopedAttentionProductPath fp32_attention(kernels::cpu::AttentionProductPath::kF32);
  int rounded = 0;
  for (const OpCase& c : test::all_cases()) {
    // Composite cases round inside (the fused output layer + loss its logits, the two-block ring attention its
    // partial outputs before the merge, the grouped MLP after each step: ops_grouped_mlp_test), so their outputs
    // are not a rounding of the fp32 run's.
    const auto runs = [&](const char* op) { return std::find(c.ops.begin(), c.ops.end(), op) != c.ops.end(); };
    if (runs("linear_cross_entropy") || runs("attention_merge") || runs("grouped_mlp_forward")) continue;
    // Cases on bf16 / fp16 tensors (the low-precision linear layer, conversions) hold 16-bit values already.
    const Env probe = test::make_env(c, DType::kF32);
    const auto fp32_only = std::all_of(probe.tensors().begin(), probe.tensors().end(),
                                       [](const auto& named) { return named.second.dtype() == DType::kF32; });
    if (!fp32_only) continue;
    const bool router =
        std::any_of(c.ops.begin(), c.ops.end(), [](const std::string& op) { return kRouterOps.count(op) != 0; });
    Env plain = inputs_in(c, dtype);
    Env scoped = inputs_in(c, dtype);
    c.forward(plain);
    {
      const ScopedActivationDType precision(dtype);
      ASSERT_EQ(activation_dtype(), dtype);
      c.forward(scoped);
    }
    ASSERT_EQ(activation_dtype(), DType::kF32);
    expect_rounded_or_kept(c.name + " forward", plain, scoped, dtype, router, rounded);
    if (!c.has_backward()) continue;
    // The backward reads forward outputs (attention's out), so both runs start from the scoped forward's state.
    copy_values(plain, scoped);
    c.backward(plain);
    {
      const ScopedActivationDType precision(dtype);
      c.backward(scoped);
    }
    expect_rounded_or_kept(c.name + " backward", plain, scoped, dtype, router, rounded);
  }
  EXPECT_GT(rounded, 20);  // the check saw real rounding, not only already-representable values
}

INSTANTIATE_TEST_SUITE_P(Dtypes, OpsPrecision, ::testing::Values(DType::kBF16, DType::kF16),
                         [](const auto& param_info) { return std::string(dtype_name(param_info.param)); });

// The activation tensors of the cases (inputs, outputs and their gradients; a trailing expert number stripped): what
// the model stores as bf16 / fp16 tensors under 16-bit activation storage. Parameters, statistics, router tensors,
// losses and weight gradients stay fp32 tensors.
const std::set<std::string> kActivationTensors = {
    "out", "inp", "x",  "y",  "in",   "q",    "k",  "v",  "xs", "h",  "fc1", "qkv", "src",  "logits", "pout",
    "ka",  "kb",  "va", "vb", "dout", "dinp", "dx", "dy", "dq", "dk", "dv",  "dh",  "dfc1", "dqkv",   "dlogits"};

std::string stem(const std::string& name) { return name.substr(0, name.find_last_not_of("0123456789") + 1); }

// The case's inputs rounded to `dtype` (fp32 tensors), on `device`.
Env rounded_inputs(const OpCase& c, const DType dtype, const Device device) {
  Env env = test::make_env(c, DType::kF32, device);
  std::vector<std::string> names;
  for (const auto& [name, t] : env.tensors()) names.push_back(name);
  for (const std::string& name : names) round_to_dtype_(env(name), dtype);
  return env;
}

// Its activation tensors (kActivationTensors) as `dtype` tensors holding the same values. Counts them.
int narrow_activations(Env& env, const DType dtype) {
  std::vector<std::string> names;
  for (const auto& [name, t] : env.tensors()) {
    if (kActivationTensors.count(stem(name)) != 0) names.push_back(name);
  }
  for (const std::string& name : names) {
    Tensor bits(env(name).shape(), dtype, MemCategory::kOther, env.device());
    convert(bits, env(name));
    env.put(name, std::move(bits));
  }
  return static_cast<int>(names.size());
}

// Every tensor of `stored` (16-bit ones read in fp32) equals `want`'s bit for bit.
void expect_same_values(const std::string& what, Env& want, Env& stored) {
  for (const auto& [name, w] : want.tensors()) {
    const Tensor& got = stored(name);
    Tensor got_f32 = got;
    if (got.dtype() != w.dtype()) {
      got_f32 = Tensor(got.shape(), w.dtype(), MemCategory::kOther, got.device());
      convert(got_f32, got);
    }
    ASSERT_EQ(got_f32.numel(), w.numel()) << what << ": " << name;
    for (int64_t i = 0; i < w.numel(); ++i) {
      ASSERT_EQ(got_f32.data<float>()[i], w.data<float>()[i])
          << what << ": " << name << "[" << i << "] stored as " << dtype_name(got.dtype());
    }
  }
}

// 16-bit activation storage (ops/staging.h): every case of the op table on both devices, once with its activation
// tensors in fp32 tensors and once as bf16 / fp16 tensors, both under ScopedActivationDType(dtype): the ops read 16-bit
// tensors exactly and narrow what they write once, so every tensor must come out bit for bit the same (the fp32
// path's rounded result).
TEST_P(OpsPrecision, SixteenBitTensorsMatchTheFp32Path) {
  const DType dtype = GetParam();
  // The fused grouped MLP runs on the convert path of the 16-bit GEMMs (the native one goes through linear layers).
  const kernels::cpu::ScopedLowpGemmPath convert(kernels::cpu::LowpGemmPath::kConvert);
  int narrowed = 0;
  for (const Device device : {Device::kCPU, Device::kReference}) {
    for (const OpCase& c : test::all_cases()) {
      const bool router =
          std::any_of(c.ops.begin(), c.ops.end(), [](const std::string& op) { return kRouterOps.count(op) != 0; });
      const Env probe = test::make_env(c, DType::kF32, device);
      const auto fp32_only = std::all_of(probe.tensors().begin(), probe.tensors().end(),
                                         [](const auto& named) { return named.second.dtype() == DType::kF32; });
      if (router || !fp32_only) continue;
      if (!std::all_of(c.ops.begin(), c.ops.end(),
                       [&](const std::string& op) { return supports(op, DType::kF32, device); })) {
        continue;
      }
      const std::string what = c.name + " on " + std::string(device_name(device));
      Env fp32 = rounded_inputs(c, dtype, device);
      Env bits16 = rounded_inputs(c, dtype, device);
      narrowed += narrow_activations(bits16, dtype);
      const ScopedActivationDType precision(dtype, device);
      c.forward(fp32);
      c.forward(bits16);
      expect_same_values(what + " forward", fp32, bits16);
      if (!c.has_backward()) continue;
      c.backward(fp32);
      c.backward(bits16);
      expect_same_values(what + " backward", fp32, bits16);
    }
  }
  EXPECT_GT(narrowed, 100);  // the cases did run on 16-bit tensors
}

// A [rows, cols] fp32 tensor of random values representable in `dtype`.
Tensor random_lowp_values(const int64_t rows, const int64_t cols, const DType dtype, std::mt19937& gen) {
  Tensor t(std::vector<int64_t>{rows, cols}, DType::kF32);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = round_to(normal(gen), dtype);
  return t;
}

// Under a 16-bit activation scope with the native path forced, ops::linear_forward / linear_backward on fp32 tensors
// holding 16-bit values run the CPU's bf16 / fp16 GEMM on their bits. Each output must equal the sum computed in
// double and rounded as the scope rounds: activations (out, dinp) to the 16-bit format, which the fp32-accumulated
// sum reaches within one 16-bit ulp (the fp32 sum's own error, ~K * 2^-24 relative, is far below half an ulp, so only
// ties can round the other way); fp32 weight gradients within 1e-5 relative to the sum of magnitudes (K = 96 products
// at 2^-24 each).
TEST_P(OpsPrecision, LinearNativePathMatchesTheReference) {
  const DType dtype = GetParam();
  const auto type = dtype == DType::kBF16 ? kernels::LowpType::kBF16 : kernels::LowpType::kF16;
  std::string why_not;
  if (!kernels::cpu::lowp_native_available(type, &why_not)) GTEST_SKIP() << why_not;
  const kernels::cpu::ScopedLowpGemmPath native(kernels::cpu::LowpGemmPath::kNative);
  constexpr int64_t T = 37, I = 96, O = 80;
  std::mt19937 gen(7);
  const Tensor x_TI = random_lowp_values(T, I, dtype, gen);
  const Tensor w_OI = random_lowp_values(O, I, dtype, gen);
  Tensor b_O(std::vector<int64_t>{O}, DType::kF32);
  std::copy_n(random_lowp_values(1, O, dtype, gen).data<float>(), O, b_O.data<float>());
  const Tensor dy_TO = random_lowp_values(T, O, dtype, gen);
  Tensor y_TO(std::vector<int64_t>{T, O}, DType::kF32);
  Tensor dx_TI = Tensor::zeros({T, I}, DType::kF32);
  Tensor dw_OI = Tensor::zeros({O, I}, DType::kF32);
  {
    const ScopedActivationDType precision(dtype);
    linear_forward(y_TO, x_TI, w_OI, &b_O);
    linear_backward(&dx_TI, &dw_OI, nullptr, dy_TO, &x_TI, w_OI);
  }
  const float* x = x_TI.data<float>();
  const float* w = w_OI.data<float>();
  const float* dy = dy_TO.data<float>();
  const int precision_bits = dtype == DType::kBF16 ? 8 : 11;
  const auto ulp_of = [&](const float v) {  // spacing of the 16-bit values around v (normal range)
    int exponent = 0;
    std::frexp(v, &exponent);
    return std::ldexp(1.0f, exponent - precision_bits);
  };
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t o = 0; o < O; ++o) {
      double sum = b_O.data<float>()[o];
      for (int64_t i = 0; i < I; ++i) sum += static_cast<double>(x[t * I + i]) * w[o * I + i];
      const float expected = round_to(static_cast<float>(sum), dtype);
      ASSERT_LE(std::abs(y_TO.data<float>()[t * O + o] - expected), ulp_of(expected)) << "out[" << t << "," << o << "]";
      ASSERT_EQ(y_TO.data<float>()[t * O + o], round_to(y_TO.data<float>()[t * O + o], dtype));
    }
    for (int64_t i = 0; i < I; ++i) {
      double sum = 0.0;
      for (int64_t o = 0; o < O; ++o) sum += static_cast<double>(dy[t * O + o]) * w[o * I + i];
      const float expected = round_to(static_cast<float>(sum), dtype);
      ASSERT_LE(std::abs(dx_TI.data<float>()[t * I + i] - expected), ulp_of(expected))
          << "dinp[" << t << "," << i << "]";
    }
  }
  for (int64_t o = 0; o < O; ++o) {
    for (int64_t i = 0; i < I; ++i) {
      double sum = 0.0, magnitude = 0.0;
      for (int64_t t = 0; t < T; ++t) {
        sum += static_cast<double>(dy[t * O + o]) * x[t * I + i];
        magnitude += std::abs(static_cast<double>(dy[t * O + o]) * x[t * I + i]);
      }
      ASSERT_NEAR(dw_OI.data<float>()[o * I + i], sum, 1e-5 * magnitude) << "dweight[" << o << "," << i << "]";
    }
  }
}

TEST(OpsPrecision, ScopesNestAndRejectOtherDtypes) {
  EXPECT_EQ(activation_dtype(), DType::kF32);
  {
    const ScopedActivationDType outer(DType::kBF16);
    {
      const ScopedActivationDType inner(DType::kF32);
      EXPECT_EQ(activation_dtype(), DType::kF32);
    }
    EXPECT_EQ(activation_dtype(), DType::kBF16);
  }
  EXPECT_EQ(activation_dtype(), DType::kF32);
  EXPECT_THROW(ScopedActivationDType(DType::kF64), std::invalid_argument);
  Tensor t(std::vector<int64_t>{3}, DType::kF32);
  t.data<float>()[0] = 1.0f + 1.0f / 512.0f;  // halfway between bf16 neighbours 1 and 1 + 2^-7: to even, 1
  t.data<float>()[1] = 70000.0f;              // beyond fp16's largest finite value
  t.data<float>()[2] = 3.0f;
  Tensor h = t.clone();
  round_to_dtype_(t, DType::kBF16);
  EXPECT_EQ(t.data<float>()[0], 1.0f);
  EXPECT_EQ(t.data<float>()[2], 3.0f);
  round_to_dtype_(h, DType::kF16);
  EXPECT_TRUE(std::isinf(h.data<float>()[1]));
  Tensor d(std::vector<int64_t>{1}, DType::kF64);
  EXPECT_THROW(round_to_dtype_(d, DType::kBF16), std::invalid_argument);
}

}  // namespace
}  // namespace moecore::ops
