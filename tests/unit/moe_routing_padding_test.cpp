// --moe-router-padding-for-quantization (moe/routing_padding.h, Megatron's pad_routing_map): on a hand-made routing
// map each expert gets its first (-count mod align) unrouted tokens, lowest index first; the alignments per recipe;
// and in a MoE layer the padded dispatch gives every expert a multiple of the alignment, the padded rows have
// probability 0, and the layer's output, input gradient and parameter gradients equal the unpadded layer's (the
// zero-probability rows add exact zeros; only the GEMMs' summation order may differ), while the router's statistics
// (tokens per expert, aux loss) are the unpadded ones, as Megatron pads after the router.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "moecore/moe/moe_layer.h"
#include "moecore/moe/routing_padding.h"
#include "moecore/parallel/parallel_state.h"

namespace moecore {
namespace {

TEST(MoERoutingPadding, LowestUnroutedTokensFillEachExpert) {
  // T = 6 tokens, E = 3 experts, align 4.
  std::vector<uint8_t> map_TE = {
      1, 0, 0,  // t0
      0, 1, 0,  // t1
      1, 1, 0,  // t2
      0, 0, 0,  // t3
      0, 0, 1,  // t4
      1, 0, 0,  // t5
  };
  // e0 has 3 -> 1 more: t1. e1 has 2 -> 2 more: t0, t3. e2 has 1 -> 3 more: t0, t1, t2.
  const std::vector<uint8_t> expected_TE = {
      1, 1, 1,  // t0
      1, 1, 1,  // t1
      1, 1, 1,  // t2
      0, 1, 0,  // t3
      0, 0, 1,  // t4
      1, 0, 0,  // t5
  };
  const std::vector<int64_t> counts = pad_routing_map(map_TE, 6, 3, 4);
  EXPECT_EQ(map_TE, expected_TE);
  EXPECT_EQ(counts, (std::vector<int64_t>{4, 4, 4}));
}

TEST(MoERoutingPadding, AlignedExpertsAndShortColumns) {
  // Already a multiple: unchanged. Too few unrouted tokens: every token, short of the multiple (as Megatron).
  std::vector<uint8_t> map_TE = {1, 0, 1, 0, 0, 1};  // T = 3, E = 2: e0 has 2, e1 has 1
  EXPECT_EQ(pad_routing_map(map_TE, 3, 2, 2), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(map_TE, (std::vector<uint8_t>{1, 1, 1, 0, 0, 1}));
  EXPECT_EQ(pad_routing_map(map_TE, 3, 2, 16), (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(map_TE, (std::vector<uint8_t>{1, 1, 1, 1, 1, 1}));
  EXPECT_THROW(pad_routing_map(map_TE, 3, 2, 0), std::invalid_argument);
}

TEST(MoERoutingPadding, AlignmentPerRecipe) {
  // megatron/core/fp8_utils.py get_fp8_align_size, megatron/core/fp4_utils.py get_fp4_align_size.
  EXPECT_EQ(align_size_for_quantization(quant::Recipe::kDelayed), 16);
  EXPECT_EQ(align_size_for_quantization(quant::Recipe::kTensorwise), 16);
  EXPECT_EQ(align_size_for_quantization(quant::Recipe::kBlockwise), 16);
  EXPECT_EQ(align_size_for_quantization(quant::Recipe::kMxfp8), 32);
  EXPECT_EQ(align_size_for_quantization(quant::Recipe::kNvfp4), 128);
}

constexpr int64_t kS = 32, kB = 2, kH = 32, kE = 4, kAlign = 16;

ModelConfig moe_model(const bool grouped, const bool bias) {
  ModelConfig model;
  model.num_layers = 1;
  model.hidden_size = kH;
  model.ffn_hidden_size = 64;
  model.activation = bias ? Activation::kGelu : Activation::kSwiGLU;
  model.add_bias_linear = bias;
  model.moe.num_experts = kE;
  model.moe.ffn_hidden_size = 32;
  model.moe.topk = 2;
  model.moe.grouped_gemm = grouped;
  model.moe.load_balancing_types = {LoadBalancingType::kAuxLoss};
  model.moe.aux_loss_coeffs = {1e-2};
  model.moe.z_loss_coeff = 1e-3;
  model.moe.dispatcher_type = TokenDispatcherType::kAllToAll;
  model.moe.moe_layer_pattern = {true};
  return model;
}

struct LayerRun {
  std::vector<float> out_TH, dx_TH;
  std::vector<std::vector<float>> grads;
  std::vector<int64_t> router_tokens_E, dispatched_E;
  std::vector<double> losses;
  std::vector<float> probs_R;
};

LayerRun run_layer(const bool grouped, const bool bias, const int64_t padding) {
  ModelConfig model = moe_model(grouped, bias);
  model.moe.router_padding_multiple = padding;
  model.moe.validate(1);
  ParamStore params;
  MoELayer layer(model, "decoder.layers.0.", params, parallel::ParallelState::single_process(), 0);
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (Param& p : params) {
    for (int64_t i = 0; i < p.value.numel(); ++i) p.value.data<float>()[i] = normal(gen);
    p.grad.zero_();
  }
  std::vector<float> x_TH(static_cast<size_t>(kS * kB * kH)), dout_TH(x_TH.size());
  for (float& v : x_TH) v = normal(gen);
  for (float& v : dout_TH) v = normal(gen);
  LayerRun run;
  run.out_TH.resize(x_TH.size());
  run.dx_TH.assign(x_TH.size(), 0.0f);
  MoELayerActivations saved;
  const Tensor x = Tensor::from_blob(x_TH.data(), {kS * kB, kH});
  const Tensor out = layer.forward(x, kS, kB, TokenRows{}, true, 1, 2, saved);
  const Tensor dx = layer.backward(Tensor::from_blob(dout_TH.data(), {kS * kB, kH}), x, 1.0, saved);
  std::copy_n(out.data<float>(), out.numel(), run.out_TH.begin());
  std::copy_n(dx.data<float>(), dx.numel(), run.dx_TH.begin());
  for (const Param& p : params) run.grads.emplace_back(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
  run.router_tokens_E = saved.routing.tokens_per_expert_E;
  run.dispatched_E = saved.dispatch.tokens_per_expert_E;
  run.losses = saved.routing.load_balancing_losses;
  run.losses.push_back(saved.routing.z_loss);
  const Tensor& probs_R = saved.dispatch.probs_R;
  run.probs_R.assign(probs_R.data<float>(), probs_R.data<float>() + probs_R.numel());
  return run;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float scale = 0.0f;
  for (const float v : want) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-6f * scale) << what << "[" << i << "]";
}

class MoERoutingPaddingLayer : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(MoERoutingPaddingLayer, PaddedRowsChangeNothing) {
  const auto [grouped, bias] = GetParam();
  const LayerRun plain = run_layer(grouped, bias, 0);
  const LayerRun padded = run_layer(grouped, bias, kAlign);
  int64_t added = 0;
  for (int64_t e = 0; e < kE; ++e) {
    EXPECT_EQ(padded.dispatched_E[e] % kAlign, 0) << "expert " << e << " got " << padded.dispatched_E[e];
    EXPECT_GE(padded.dispatched_E[e], plain.dispatched_E[e]);
    added += padded.dispatched_E[e] - plain.dispatched_E[e];
  }
  EXPECT_GT(added, 0) << "nothing was padded: the test needs counts off the multiple";
  // The padded rows carry probability 0 (every routed token's softmax probability is positive).
  const auto zero_probs = std::count(padded.probs_R.begin(), padded.probs_R.end(), 0.0f);
  EXPECT_EQ(zero_probs, added);
  EXPECT_EQ(std::count(plain.probs_R.begin(), plain.probs_R.end(), 0.0f), 0);
  // The router's statistics come from the unpadded map.
  EXPECT_EQ(padded.router_tokens_E, plain.router_tokens_E);
  EXPECT_EQ(padded.losses, plain.losses);
  expect_close(padded.out_TH, plain.out_TH, "out");
  expect_close(padded.dx_TH, plain.dx_TH, "dx");
  ASSERT_EQ(padded.grads.size(), plain.grads.size());
  for (size_t i = 0; i < plain.grads.size(); ++i)
    expect_close(padded.grads[i], plain.grads[i], "grad " + std::to_string(i));
}

INSTANTIATE_TEST_SUITE_P(Experts, MoERoutingPaddingLayer, ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& param_info) {
                           return std::string(std::get<0>(param_info.param) ? "grouped" : "sequential") +
                                  (std::get<1>(param_info.param) ? "_bias" : "_swiglu");
                         });

}  // namespace
}  // namespace moecore
