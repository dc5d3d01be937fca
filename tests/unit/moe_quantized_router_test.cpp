// FP8 / FP4 in a MoE layer (ops/quantization.h): under every recipe the router stays high precision, so its logits
// are bit for bit those of the unquantized layer (Megatron computes them with a plain GEMM outside TE's modules),
// while the experts' output differs (they did quantize); backward runs with the shared experts' [1, H] gate, which
// no FP8 / FP4 block covers and which stays high precision too.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "moecore/moe/moe_layer.h"
#include "moecore/ops/quantization.h"
#include "moecore/parallel/parallel_state.h"

namespace moecore {
namespace {

using quant::Recipe;

constexpr int64_t kS = 16, kB = 2, kH = 64;

ModelConfig moe_model() {
  ModelConfig model;
  model.num_layers = 1;
  model.hidden_size = kH;
  model.ffn_hidden_size = 128;
  model.activation = Activation::kSwiGLU;
  model.add_bias_linear = false;
  model.moe.num_experts = 4;
  model.moe.ffn_hidden_size = 64;
  model.moe.topk = 2;
  model.moe.grouped_gemm = true;
  model.moe.router_dtype = RouterDType::kFP32;
  model.moe.shared_expert_intermediate_size = 64;
  model.moe.shared_expert_gate = true;
  model.moe.moe_layer_pattern = {true};
  return model;
}

struct LayerRun {
  std::vector<double> logits_TE;
  std::vector<float> out_TH;
};

LayerRun run_layer(const quant::QuantizedLinearConfig* config) {
  const ModelConfig model = moe_model();
  ParamStore params;
  MoELayer layer(model, "decoder.layers.0.", params, parallel::ParallelState::single_process(), 0);
  std::mt19937 gen(42);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (Param& p : params) {
    for (int64_t i = 0; i < p.value.numel(); ++i) p.value.data<float>()[i] = normal(gen);
    p.grad.zero_();
  }
  std::vector<float> x_TH(static_cast<size_t>(kS * kB * kH)), dout_TH(x_TH.size()), dx_TH(x_TH.size(), 0.0f);
  for (float& v : x_TH) v = normal(gen);
  for (float& v : dout_TH) v = normal(gen);
  LayerRun run;
  run.out_TH.resize(x_TH.size());
  MoELayerActivations saved;
  const ops::ScopedLinearQuantization scope(config);  // as TransformerLayer opens it
  const Tensor x = Tensor::from_blob(x_TH.data(), {kS * kB, kH});
  const Tensor out = layer.forward(x, kS, kB, TokenRows{}, true, 1, 2, saved);
  const Tensor dx = layer.backward(Tensor::from_blob(dout_TH.data(), {kS * kB, kH}), x, 1.0, saved);
  std::copy_n(out.data<float>(), out.numel(), run.out_TH.begin());
  std::copy_n(dx.data<float>(), dx.numel(), dx_TH.begin());
  const Tensor& logits = saved.router.logits_TE;
  for (int64_t i = 0; i < logits.numel(); ++i) {
    run.logits_TE.push_back(logits.dtype() == DType::kF32 ? static_cast<double>(logits.data<float>()[i])
                                                          : logits.data<double>()[i]);
  }
  return run;
}

class MoEQuantizedRouter : public ::testing::TestWithParam<Recipe> {};

TEST_P(MoEQuantizedRouter, RouterLogitsStayExactWhileExpertsQuantize) {
  const LayerRun plain = run_layer(nullptr);
  quant::QuantizedLinearConfig config;
  config.recipe = GetParam();
  config.format = quant::Fp8Format::kHybrid;
  const LayerRun quantized = run_layer(&config);
  ASSERT_EQ(quantized.logits_TE.size(), plain.logits_TE.size());
  ASSERT_FALSE(plain.logits_TE.empty());
  for (size_t i = 0; i < plain.logits_TE.size(); ++i) ASSERT_EQ(quantized.logits_TE[i], plain.logits_TE[i]) << i;
  EXPECT_FALSE(std::equal(plain.out_TH.begin(), plain.out_TH.end(), quantized.out_TH.begin()));
}

INSTANTIATE_TEST_SUITE_P(Recipes, MoEQuantizedRouter,
                         ::testing::Values(Recipe::kTensorwise, Recipe::kBlockwise, Recipe::kMxfp8, Recipe::kNvfp4),
                         [](const ::testing::TestParamInfo<Recipe>& param) { return quant::recipe_name(param.param); });

}  // namespace
}  // namespace moecore
