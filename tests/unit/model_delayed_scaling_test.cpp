// FP8 delayed scaling in a training model (--fp8-recipe delayed; GPTModel::delayed_scaling): every decoder-layer
// linear (attention, dense MLP, each routed expert's fc1 / fc2, shared experts) has a state; over training steps the
// first layer's qkv input is quantized with scale 1, then with 448 / (the newest amax, most_recent, or the largest of
// the last L, max), the amaxes being max |qkv input| read from the saved activations; the weight with 448 / max |W|
// from step 2 on; within a step of two micro-batches the input scale moves after the first micro-batch's forward
// (TE's autocast exit) while the weight keeps the first micro-batch's cast.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "moecore/model/gpt_model.h"
#include "unit/tiny_model_fixture.h"

namespace moecore {
namespace {

constexpr int64_t kB = 2, kS = 8;
constexpr uint64_t kSeed = 99;
constexpr float kE4M3Max = 448.0f;

// The tiny MoE model with a shared expert of width 32, under delayed scaling. The linear layers keep their inputs in
// high precision (not only quantized for wgrad, ops/linear.h: the same training), so the amaxes can be read from them.
ModelConfig delayed_moe(const int64_t L, const quant::AmaxComputeAlgo algo) {
  ModelConfig c = test::tiny_moe_config(kS);
  c.moe.shared_expert_intermediate_size = 32;
  c.quantization = test::fp8_delayed(L, algo);
  c.quantization->save_quantized_input = false;
  return c;
}

float abs_max(const Tensor& t) {
  float m = 0.0f;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(t.data<float>()[i]));
  return m;
}

struct Batch {
  std::vector<int32_t> tokens, labels;
};

Batch random_batch(std::mt19937& gen, const int64_t vocab) {
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
  Batch b;
  for (int64_t i = 0; i < kB * kS; ++i) {
    b.tokens.push_back(id(gen));
    b.labels.push_back(id(gen));
  }
  return b;
}

class ModelDelayedScaling : public ::testing::TestWithParam<std::tuple<int64_t, quant::AmaxComputeAlgo>> {};

TEST_P(ModelDelayedScaling, FirstLayerQkvFollowsItsAmaxHistory) {
  const auto [L, algo] = GetParam();
  const ModelConfig config = delayed_moe(L, algo);
  GPTModel model(config, kSeed);
  // Layer 0 (dense): qkv, proj, fc1, fc2; layer 1 (MoE): qkv, proj, 4 experts x (fc1, fc2), shared fc1, fc2.
  const std::vector<DelayedScalingEntry>& entries = model.delayed_scaling().entries();
  ASSERT_EQ(entries.size(), 4u + 2u + 8u + 2u);
  EXPECT_EQ(entries.front().name, "decoder.layers.0.self_attention.linear_qkv");
  const float w_amax = abs_max(model.param("decoder.layers.0.self_attention.linear_qkv.weight").value);
  std::mt19937 gen(5);
  std::deque<float> amaxes;  // the qkv input's amax per step, newest last (at most L)
  ForwardOptions options;
  for (int step = 1; step <= 5; ++step) {
    const Batch batch = random_batch(gen, config.vocab_size);
    std::unique_ptr<MicroBatchContext> ctx;
    model.forward(ctx, batch.tokens.data(), batch.labels.data(), nullptr, kB, kS, options);
    const LinearActivations& qkv = ctx->layers[0].attention.qkv;
    float expected = 1.0f;
    if (!amaxes.empty()) {
      const bool max_algo = algo == quant::AmaxComputeAlgo::kMax;
      expected = kE4M3Max / (max_algo ? *std::max_element(amaxes.begin(), amaxes.end()) : amaxes.back());
    }
    EXPECT_FLOAT_EQ(qkv.delayed.input, expected) << "step " << step;
    EXPECT_FLOAT_EQ(qkv.delayed.weight, step == 1 ? 1.0f : kE4M3Max / w_amax) << "step " << step;
    amaxes.push_back(abs_max(qkv.input_TI));
    if (static_cast<int64_t>(amaxes.size()) > L) amaxes.pop_front();
    model.backward(std::move(ctx), 1.0);
    model.zero_grad();
  }
  // Every linear's weight (unchanged: no optimizer here) was cast at step 1, experts without tokens included.
  for (const DelayedScalingEntry& e : entries) {
    const float amax = abs_max(model.param(e.name + ".weight").value);
    EXPECT_FLOAT_EQ(e.state->scale_fwd()[1], kE4M3Max / amax) << e.name;
    EXPECT_NE(e.state->scale_bwd()[0], 1.0f) << e.name << ": its gradient scale never moved";
  }
}

INSTANTIATE_TEST_SUITE_P(HistoryAndAlgo, ModelDelayedScaling,
                         ::testing::Values(std::tuple{int64_t{1}, quant::AmaxComputeAlgo::kMostRecent},
                                           std::tuple{int64_t{3}, quant::AmaxComputeAlgo::kMostRecent},
                                           std::tuple{int64_t{2}, quant::AmaxComputeAlgo::kMax},
                                           std::tuple{int64_t{4}, quant::AmaxComputeAlgo::kMax}),
                         [](const auto& param_info) {
                           return "len" + std::to_string(std::get<0>(param_info.param)) + "_" +
                                  quant::amax_compute_algo_name(std::get<1>(param_info.param));
                         });

TEST(ModelDelayedScalingMicroBatches, InputScalesMoveEachMicroBatchWeightsOncePerStep) {
  const ModelConfig config = delayed_moe(1, quant::AmaxComputeAlgo::kMostRecent);
  GPTModel model(config, kSeed);
  std::mt19937 gen(6);
  const Batch b1 = random_batch(gen, config.vocab_size), b2 = random_batch(gen, config.vocab_size);
  ForwardOptions first, later;
  first.backward_seed = later.backward_seed = 0.5;
  later.is_first_microbatch = false;
  // Step 1, two micro-batches forward before their backwards (as a pipeline schedule may run them).
  std::unique_ptr<MicroBatchContext> c1, c2;
  model.forward(c1, b1.tokens.data(), b1.labels.data(), nullptr, kB, kS, first);
  model.forward(c2, b2.tokens.data(), b2.labels.data(), nullptr, kB, kS, later);
  const LinearActivations &q1 = c1->layers[0].attention.qkv, &q2 = c2->layers[0].attention.qkv;
  EXPECT_EQ(q1.delayed.input, 1.0f);
  EXPECT_FLOAT_EQ(q2.delayed.input, kE4M3Max / abs_max(q1.input_TI));  // updated after micro-batch 1's forward
  EXPECT_EQ(q2.delayed.weight, q1.delayed.weight);                     // the FP8 weight of micro-batch 1
  const float second_amax = abs_max(q2.input_TI);
  model.backward(std::move(c1), 0.5);
  model.backward(std::move(c2), 0.5);
  // Step 2: the input scale is micro-batch 2's (most_recent), the weight is cast afresh at 448 / max |W|.
  std::unique_ptr<MicroBatchContext> c3;
  model.forward(c3, b1.tokens.data(), b1.labels.data(), nullptr, kB, kS, first);
  const LinearActivations& q3 = c3->layers[0].attention.qkv;
  EXPECT_FLOAT_EQ(q3.delayed.input, kE4M3Max / second_amax);
  EXPECT_FLOAT_EQ(q3.delayed.weight,
                  kE4M3Max / abs_max(model.param("decoder.layers.0.self_attention.linear_qkv.weight").value));
}

TEST(ModelDelayedScalingMicroBatches, EvaluationRecordsButDoesNotUpdate) {
  const ModelConfig config = delayed_moe(1, quant::AmaxComputeAlgo::kMostRecent);
  GPTModel model(config, kSeed);
  std::mt19937 gen(7);
  const Batch b = random_batch(gen, config.vocab_size);
  ForwardOptions eval;
  eval.training = false;
  std::unique_ptr<MicroBatchContext> ctx;
  model.forward(ctx, b.tokens.data(), b.labels.data(), nullptr, kB, kS, eval);
  quant::DelayedLinearScaling& qkv = *model.delayed_scaling().entries().front().state;
  EXPECT_EQ(qkv.scale_fwd()[0], 1.0f);
  EXPECT_GT(qkv.pending_forward_amaxes()[0], 0.0f);  // folded into the next training update, as TE
}

}  // namespace
}  // namespace moecore
