// FP8 / FP4 in the model (ModelConfig::quantization, --first-last-layers-bf16): each decoder layer quantizes its
// linear layers unless it is one of the first / last layers kept in high precision (Megatron's
// is_first_last_bf16_layer, global layer numbers). Checked per pipeline stage of one layer: a high-precision layer
// gives bit for bit the unquantized model's numbers, a quantized one does not.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "moecore/model/gpt_model.h"
#include "unit/tiny_model_fixture.h"

namespace moecore {
namespace {

constexpr int64_t kB = 2, kS = 8;
constexpr uint64_t kSeed = 1234;

// The tiny MoE model with 3 layers (MoE, dense, MoE), a vocabulary of 96, sequential experts.
ModelConfig three_layer_moe() {
  ModelConfig c = test::tiny_moe_config(kS);
  c.num_layers = 3;
  c.vocab_size = 96;
  c.moe.grouped_gemm = false;
  c.moe.moe_layer_pattern = {true, false, true};
  return c;
}

// The output of each one-layer stage fed with the same input: layer 0 from the tokens, layers 1 and 2 from a fixed
// random hidden state (layer 2 ends in the loss, reported as its only element).
std::vector<std::vector<float>> stage_results(const ModelConfig& config) {
  std::mt19937 gen(7);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(config.vocab_size - 1));
  std::vector<int32_t> tokens_BS, labels_BS;
  for (int64_t i = 0; i < kB * kS; ++i) {
    tokens_BS.push_back(id(gen));
    labels_BS.push_back(id(gen));
  }
  const std::vector<float> mask_BS(static_cast<size_t>(kB * kS), 1.0f);
  Tensor hidden = Tensor::zeros({kS * kB, config.hidden_size});
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : hidden.span<float>()) v = normal(gen);
  ForwardOptions options;
  options.training = true;
  const auto single = parallel::ParallelState::single_process();
  std::vector<std::vector<float>> results;
  for (int64_t layer = 0; layer < 3; ++layer) {
    GPTModel stage(config, kSeed, single, StageSpec{layer, 1, layer == 0, layer == 2});
    std::unique_ptr<MicroBatchContext> ctx;
    if (layer > 0) stage.set_input_tensor(hidden.clone());
    const double loss =
        stage.forward(ctx, layer == 0 ? tokens_BS.data() : nullptr, layer == 2 ? labels_BS.data() : nullptr,
                      layer == 2 ? mask_BS.data() : nullptr, kB, kS, options);
    if (layer == 2) {
      results.push_back({static_cast<float>(loss)});
    } else {
      const std::span<const float> out = ctx->output_TH.span<float>();
      results.emplace_back(out.begin(), out.end());
    }
  }
  return results;
}

ModelConfig quantized(const bool first_last, const int64_t start, const int64_t end) {
  ModelConfig c = three_layer_moe();
  quant::QuantizedLinearConfig q;
  q.recipe = quant::Recipe::kTensorwise;
  q.format = quant::Fp8Format::kHybrid;
  c.quantization = q;
  c.first_last_layers_bf16 = first_last;
  c.num_layers_at_start_in_bf16 = start;
  c.num_layers_at_end_in_bf16 = end;
  return c;
}

TEST(ModelQuantizedLayers, FirstAndLastLayersStayHighPrecision) {
  const auto plain = stage_results(three_layer_moe());
  const auto all = stage_results(quantized(false, 1, 1));
  const auto edges = stage_results(quantized(true, 1, 1));
  for (size_t layer = 0; layer < 3; ++layer) {
    EXPECT_NE(all[layer], plain[layer]) << "layer " << layer << " did not quantize";
    if (layer == 1) {
      EXPECT_EQ(edges[layer], all[layer]) << "the middle layer quantizes";
    } else {
      EXPECT_EQ(edges[layer], plain[layer]) << "layer " << layer << " is kept in high precision";
    }
  }
  // Zero layers at either end: every layer quantizes.
  EXPECT_EQ(stage_results(quantized(true, 0, 0)), all);
}

// Multi-latent attention's five projections are linear layers of the quantized layer: each weight carries the
// recipe's weight quantization (and, under delayed scaling, its own scaling state), and the layer's numbers change.
TEST(ModelQuantizedLayers, MultiLatentAttentionProjectionsQuantize) {
  ModelConfig plain = three_layer_moe();
  plain.mla = MlaConfig{16, 16, 8, 16, 16, RopeType::kYarn};  // every width a multiple of nvfp4's 16
  plain.qk_layernorm = true;
  for (const quant::Recipe recipe : {quant::Recipe::kDelayed, quant::Recipe::kNvfp4}) {
    ModelConfig c = plain;
    quant::QuantizedLinearConfig q;
    q.recipe = recipe;
    q.format = quant::Fp8Format::kE4M3;
    c.quantization = q;
    const GPTModel model(c, kSeed);
    int projections = 0;
    for (const Param& p : model.params()) {
      if (p.name.find("self_attention.linear_") == std::string::npos) continue;
      ++projections;
      EXPECT_TRUE(p.weight_quantization.has_value()) << p.name;
      EXPECT_EQ(p.delayed_scaling != nullptr, recipe == quant::Recipe::kDelayed) << p.name;
    }
    EXPECT_EQ(projections, 3 * 5);  // q_down, q_up, kv_down, kv_up, proj in each layer
    const auto quantized_results = stage_results(c);
    const auto plain_results = stage_results(plain);
    for (size_t layer = 0; layer < 3; ++layer) EXPECT_NE(quantized_results[layer], plain_results[layer]) << layer;
  }
}

}  // namespace
}  // namespace moecore
