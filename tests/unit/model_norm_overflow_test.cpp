// A norm whose sum of squares overflows fp32 outputs zeros and leaves the loss finite (ln V): the model records the
// first such norm in model order, named by its parameters' prefix, for the training step to stop on.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <optional>
#include <vector>

#include "moecore/model/gpt_model.h"
#include "moecore/model/norm_overflow.h"
#include "unit/tiny_model_fixture.h"

namespace moecore {
namespace {

constexpr int64_t kB = 2, kS = 8;

// The tiny dense model over kS positions (the embedding reaches the first norm unscaled: no dropout).
ModelConfig tiny_config(const Normalization normalization, const bool qk_layernorm = false) {
  ModelConfig c = test::tiny_dense_config(kS);
  c.max_position_embeddings = kS;
  c.normalization = normalization;
  c.qk_layernorm = qk_layernorm;
  return c;
}

double forward_loss(GPTModel& model) {
  std::vector<int32_t> tokens(kB * kS), labels(kB * kS);
  for (int64_t i = 0; i < kB * kS; ++i) {
    tokens[static_cast<size_t>(i)] = static_cast<int32_t>(i % 64);
    labels[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7) % 64);
  }
  ForwardOptions options;
  options.training = true;
  std::unique_ptr<MicroBatchContext> ctx;
  return model.forward(ctx, tokens.data(), labels.data(), nullptr, kB, kS, options);
}

void fill(Param& p, const float value) {
  for (float& v : p.value.span<float>()) v = value;
}

class ModelNormOverflow : public ::testing::TestWithParam<Normalization> {};

TEST_P(ModelNormOverflow, HugeEmbeddingsOverflowTheFirstLayersInputNorm) {
  GPTModel model(tiny_config(GetParam()), 1);
  EXPECT_TRUE(std::isfinite(forward_loss(model)));
  EXPECT_FALSE(model.take_norm_overflow().has_value()) << "ordinary weights overflow nothing";

  // Alternating signs, so that a LayerNorm's variance (not only an RMSNorm's mean square) is 1e40.
  Param& embedding = model.param("embedding.word_embeddings.weight");
  float* e = embedding.value.data<float>();
  for (int64_t i = 0; i < embedding.value.numel(); ++i) e[i] = i % 2 == 0 ? 1e20f : -1e20f;
  const double loss = forward_loss(model);
  // The silent part: every norm outputs zeros, the logits are 0 and the loss is exactly ln V.
  EXPECT_NEAR(loss, std::log(64.0), 1e-5);

  const std::optional<NormOverflow> overflow = model.take_norm_overflow();
  ASSERT_TRUE(overflow.has_value());
  EXPECT_EQ(overflow->name, "decoder.layers.0.input_layernorm");
  EXPECT_EQ(overflow->module, 0);
  EXPECT_EQ(overflow->layernorm, GetParam() == Normalization::kLayerNorm);
  EXPECT_NEAR(overflow->largest_input, 1e20, 1e14);
  EXPECT_EQ(describe_norm_overflow(*overflow),
            GetParam() == Normalization::kLayerNorm
                ? "decoder.layers.0.input_layernorm's variance overflowed fp32 (input rows with |x| up to 1e+20)"
                : "decoder.layers.0.input_layernorm's sum of squares overflowed fp32 (input rows with |x| up to "
                  "1e+20)");
  EXPECT_FALSE(model.take_norm_overflow().has_value()) << "taking it resets the record";
}

TEST_P(ModelNormOverflow, ALaterNormIsNamedWhenTheEarlierOnesHold) {
  GPTModel model(tiny_config(GetParam()), 1);
  // The second layer's MLP output is huge (+-1e20 x the sum of its activations, the sign alternating over the
  // hidden dimension so that a LayerNorm's variance is huge too): only the final norm sees it.
  Param& fc2 = model.param("decoder.layers.1.mlp.linear_fc2.weight");  // [H, F]
  const int64_t F = fc2.value.shape()[1];
  for (int64_t i = 0; i < fc2.value.numel(); ++i) fc2.value.data<float>()[i] = (i / F) % 2 == 0 ? 1e20f : -1e20f;
  forward_loss(model);
  const std::optional<NormOverflow> overflow = model.take_norm_overflow();
  ASSERT_TRUE(overflow.has_value());
  EXPECT_EQ(overflow->name, "decoder.final_layernorm");
  EXPECT_EQ(overflow->module, 2);
}

TEST(ModelNormOverflowQk, TheQueryNormIsNamed) {
  GPTModel model(tiny_config(Normalization::kRMSNorm, /*qk_layernorm=*/true), 1);
  // Huge queries, keys and values: the query norm comes first.
  Param& qkv = model.param("decoder.layers.1.self_attention.linear_qkv.weight");
  fill(qkv, 1e19f);
  forward_loss(model);
  const std::optional<NormOverflow> overflow = model.take_norm_overflow();
  ASSERT_TRUE(overflow.has_value());
  EXPECT_EQ(overflow->name, "decoder.layers.1.self_attention.q_layernorm");
}

TEST(NormOverflowLog, KeepsTheFirstInModelOrder) {
  NormOverflowLog log;
  log.record({.module = 1, .name = "decoder.layers.1.pre_mlp_layernorm"});
  log.record({.module = 1, .name = "decoder.layers.1.input_layernorm"});  // a later micro-batch, same layer
  log.record({.module = 2, .name = "decoder.final_layernorm"});
  EXPECT_EQ(log.take()->name, "decoder.layers.1.pre_mlp_layernorm");
  log.record({.module = 2, .name = "decoder.final_layernorm"});
  log.record({.module = 0, .name = "decoder.layers.0.input_layernorm"});
  EXPECT_EQ(log.take()->name, "decoder.layers.0.input_layernorm");
  EXPECT_FALSE(log.take().has_value());
}

INSTANTIATE_TEST_SUITE_P(Norms, ModelNormOverflow,
                         ::testing::Values(Normalization::kRMSNorm, Normalization::kLayerNorm),
                         [](const ::testing::TestParamInfo<Normalization>& param) {
                           return std::string(param.param == Normalization::kLayerNorm ? "LayerNorm" : "RMSNorm");
                         });

}  // namespace
}  // namespace moecore
