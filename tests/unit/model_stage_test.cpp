// A model split into two pipeline stages by hand (Megatron's pre_process / post_process): stage 1 holds the
// embedding and the first layers, stage 2 the other layers, the final norm, the output layer and the loss. Stage 1's
// output feeds stage 2; stage 2's input gradient goes back to stage 1. Loss and every gradient must equal the
// one-model run (same seed: initialisation is layout independent; global layer numbers keep the dropout masks).
// Also: the fused output layer + loss (the default) gives the loss and gradients of the unfused one (the path taken
// when the caller asks for the logits).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "moecore/model/gpt_model.h"

namespace moecore {
namespace {

constexpr int64_t kB = 2, kS = 8;
constexpr uint64_t kSeed = 1234;

ModelConfig tiny_moe_config(const bool tied, const bool learned_positions) {
  ModelConfig c;
  c.num_layers = 4;
  c.hidden_size = 32;
  c.ffn_hidden_size = 48;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.kv_channels = 8;
  c.seq_length = kS;
  c.max_position_embeddings = 16;
  c.vocab_size = 96;
  c.normalization = learned_positions ? Normalization::kLayerNorm : Normalization::kRMSNorm;
  c.activation = learned_positions ? Activation::kGelu : Activation::kSwiGLU;
  c.add_bias_linear = learned_positions;
  c.position_embedding_type = learned_positions ? PositionEmbedding::kLearnedAbsolute : PositionEmbedding::kRope;
  c.attention_dropout = 0.1;
  c.hidden_dropout = 0.1;
  c.untie_embeddings_and_output_weights = !tied;
  c.moe.num_experts = 4;
  c.moe.ffn_hidden_size = 24;
  c.moe.moe_layer_pattern = {false, true, false, true};
  c.moe.topk = 2;
  c.moe.load_balancing_types = {LoadBalancingType::kAuxLoss};
  c.moe.aux_loss_coeffs = {0.01};
  c.moe.z_loss_coeff = 1e-3;
  if (!learned_positions) {  // shared experts need --disable-bias-linear
    c.moe.shared_expert_intermediate_size = 16;
    c.moe.shared_expert_gate = true;
  }
  return c;
}

struct Batch {
  std::vector<int32_t> tokens_BS, labels_BS;
  std::vector<float> mask_BS;
};

Batch random_batch(const int64_t V) {
  std::mt19937 gen(7);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(V - 1));
  Batch b;
  for (int64_t i = 0; i < kB * kS; ++i) {
    b.tokens_BS.push_back(id(gen));
    b.labels_BS.push_back(id(gen));
    b.mask_BS.push_back(i % 5 == 0 ? 0.0f : 1.0f);
  }
  return b;
}

ForwardOptions training_options() {
  ForwardOptions o;
  o.training = true;
  o.dropout_seed = 99;
  o.dropout_stream = 3;
  o.backward_seed = 0.5;  // the loss scale the backwards below are given
  return o;
}

double max_abs(const Tensor& t) {
  double m = 0.0;
  for (const float v : t.span<float>()) m = std::max(m, static_cast<double>(std::fabs(v)));
  return m;
}

// Every parameter of `stages` has the gradient of the same-named parameter of `full`; a name held by both stages
// (the tied word embeddings) has the sum of both stages' gradients.
void expect_same_gradients(const GPTModel& full, const std::vector<const GPTModel*>& stages) {
  size_t names_seen = 0;
  for (const Param& p : full.params()) {
    std::vector<float> sum(static_cast<size_t>(p.grad.numel()), 0.0f);
    int holders = 0;
    for (const GPTModel* stage : stages) {
      for (const Param& q : stage->params()) {
        if (q.name != p.name) continue;
        ++holders;
        ASSERT_EQ(q.grad.shape(), p.grad.shape()) << p.name;
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += q.grad.data<float>()[i];
      }
    }
    ASSERT_GE(holders, 1) << p.name << " is in no stage";
    ++names_seen;
    const double scale = std::max(max_abs(p.grad), 1e-30);
    double worst = 0.0;
    for (size_t i = 0; i < sum.size(); ++i) {
      worst = std::max(worst, std::fabs(static_cast<double>(sum[i]) - p.grad.data<float>()[i]) / scale);
    }
    EXPECT_LE(worst, 1e-6) << p.name << " (held by " << holders << " stages)";
    EXPECT_GT(max_abs(p.grad), 0.0) << p.name << ": a zero gradient would make this check vacuous";
  }
  EXPECT_EQ(names_seen, full.params().size());
}

void run_two_stage_split(const bool tied, const bool learned_positions, const int64_t split) {
  const ModelConfig config = tiny_moe_config(tied, learned_positions);
  const Batch batch = random_batch(config.vocab_size);
  const ForwardOptions options = training_options();

  GPTModel full(config, kSeed);
  std::unique_ptr<MicroBatchContext> ctx;
  const double full_loss =
      full.forward(ctx, batch.tokens_BS.data(), batch.labels_BS.data(), batch.mask_BS.data(), kB, kS, options);
  full.backward(std::move(ctx), 0.5);

  const auto single = parallel::ParallelState::single_process();
  GPTModel first(config, kSeed, single, StageSpec{0, split, true, false});
  GPTModel second(config, kSeed, single, StageSpec{split, -1, false, true});
  EXPECT_EQ(first.params().size() + second.params().size(), full.params().size() + (tied ? 1 : 0));

  std::unique_ptr<MicroBatchContext> ctx1, ctx2;
  EXPECT_EQ(first.forward(ctx1, batch.tokens_BS.data(), nullptr, nullptr, kB, kS, options), 0.0);
  ASSERT_TRUE(ctx1 && ctx1->output_TH.defined());
  EXPECT_EQ(ctx1->output_TH.numel(), kB * kS * config.hidden_size);
  second.set_input_tensor(ctx1->output_TH.clone());
  const double stage_loss =
      second.forward(ctx2, nullptr, batch.labels_BS.data(), batch.mask_BS.data(), kB, kS, options);
  EXPECT_NEAR(stage_loss, full_loss, 1e-7 * std::fabs(full_loss));

  const Tensor dinput_TH = second.backward(std::move(ctx2), 0.5);
  ASSERT_TRUE(dinput_TH.defined());
  EXPECT_FALSE(first.backward(std::move(ctx1), 0.5, &dinput_TH).defined());
  expect_same_gradients(full, {&first, &second});
}

TEST(ModelStageTest, TwoStagesGiveTheOneModelLossAndGradientsUntied) { run_two_stage_split(false, false, 2); }

TEST(ModelStageTest, TwoStagesGiveTheOneModelLossAndGradientsTiedEmbeddings) { run_two_stage_split(true, false, 1); }

TEST(ModelStageTest, TwoStagesWithLearnedPositionsAndBiases) { run_two_stage_split(true, true, 3); }

TEST(ModelStageTest, StageParametersUseGlobalLayerNumbers) {
  const ModelConfig config = tiny_moe_config(false, false);
  const auto single = parallel::ParallelState::single_process();
  const GPTModel middle(config, kSeed, single, StageSpec{1, 2, false, false});
  bool saw_layer_1 = false, saw_layer_2 = false;
  for (const Param& p : middle.params()) {
    EXPECT_EQ(p.name.rfind("decoder.layers.", 0), 0u) << p.name << ": a middle stage holds only decoder layers";
    saw_layer_1 |= p.name.rfind("decoder.layers.1.", 0) == 0;
    saw_layer_2 |= p.name.rfind("decoder.layers.2.", 0) == 0;
  }
  EXPECT_TRUE(saw_layer_1 && saw_layer_2);
  // The same parameter has the same initial value whatever stage builds it.
  const GPTModel full(config, kSeed);
  const Param& a = middle.param("decoder.layers.1.mlp.router.weight");
  const Param& b = full.param("decoder.layers.1.mlp.router.weight");
  for (int64_t i = 0; i < a.value.numel(); ++i) ASSERT_EQ(a.value.data<float>()[i], b.value.data<float>()[i]);
}

void expect_fused_output_loss_matches_unfused(const bool tied) {
  const ModelConfig config = tiny_moe_config(tied, false);
  const Batch batch = random_batch(config.vocab_size);
  GPTModel fused(config, kSeed), unfused(config, kSeed);
  std::unique_ptr<MicroBatchContext> ctx_fused, ctx_unfused;
  Tensor logits_SBV;
  const double fused_loss = fused.forward(ctx_fused, batch.tokens_BS.data(), batch.labels_BS.data(),
                                          batch.mask_BS.data(), kB, kS, training_options());
  const double unfused_loss = unfused.forward(ctx_unfused, batch.tokens_BS.data(), batch.labels_BS.data(),
                                              batch.mask_BS.data(), kB, kS, training_options(), &logits_SBV);
  ASSERT_TRUE(logits_SBV.defined());
  EXPECT_FALSE(ctx_fused->logits_TV.defined()) << "the fused path must not keep the logits";
  EXPECT_TRUE(ctx_unfused->logits_TV.defined());
  EXPECT_NEAR(fused_loss, unfused_loss, 1e-6 * std::fabs(unfused_loss));
  fused.backward(std::move(ctx_fused), 0.5);
  unfused.backward(std::move(ctx_unfused), 0.5);
  expect_same_gradients(unfused, {&fused});
}

TEST(ModelStageTest, FusedOutputLossMatchesUnfusedUntied) { expect_fused_output_loss_matches_unfused(false); }

TEST(ModelStageTest, FusedOutputLossMatchesUnfusedTied) { expect_fused_output_loss_matches_unfused(true); }

TEST(ModelStageTest, BadStagesAreRefused) {
  const ModelConfig config = tiny_moe_config(false, false);
  const auto single = parallel::ParallelState::single_process();
  EXPECT_THROW(GPTModel(config, kSeed, single, StageSpec{3, 2, true, true}), ConfigError);
  GPTModel second(config, kSeed, single, StageSpec{2, -1, false, true});
  const Batch batch = random_batch(config.vocab_size);
  std::unique_ptr<MicroBatchContext> ctx;
  EXPECT_THROW(second.forward(ctx, nullptr, batch.labels_BS.data(), nullptr, kB, kS, training_options()),
               std::logic_error);  // no set_input_tensor
}

TEST(ModelStageTest, FusedOutputLossRefusesABackwardScaleOtherThanItsSeed) {
  const ModelConfig config = tiny_moe_config(false, false);
  const Batch batch = random_batch(config.vocab_size);
  GPTModel model(config, kSeed);
  std::unique_ptr<MicroBatchContext> ctx;
  model.forward(ctx, batch.tokens_BS.data(), batch.labels_BS.data(), batch.mask_BS.data(), kB, kS, training_options());
  // The weight gradient is already in the main gradient, scaled by the seed: another scale cannot be honoured.
  EXPECT_THROW(model.backward(std::move(ctx), 0.25), std::logic_error);
}

}  // namespace
}  // namespace moecore
