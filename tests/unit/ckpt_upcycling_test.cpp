// Dense-to-MoE upcycling (upcycled_state_source, Megatron's upcycling_utils.py):
// - a dense model upcycled into E=4, top-2 post-softmax experts computes the dense model's loss at iteration 0
//   (relative 1e-6): with g=1 every expert is the dense MLP and the top-2 probabilities sum to one, so the MoE output
//   sum_k p_k * y differs from y only by the rounding of p_1 + p_2 and of the two scaled products (a few float ulps);
//   with g=2 (fine-grained) the two experts sharing a router row hold the two halves of the dense FFN, each gets
//   p = 1/2 and squared ReLU's s^3 = 2 cancels it, so the pieces together are the dense FFN (same rounding argument);
// - the router is the MoE model's own init with its first E/g rows repeated, the experts' pieces and scales follow
//   the index formulas written here (SwiGLU halves re-paired; pre-softmax a = E*g/topk; GeLU's square root);
// - a few AdamW steps from the upcycled model lower the loss;
// - bad granularity, shared experts and a dense checkpoint of the wrong width give one-line errors.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "moecore/ckpt/model_state_keys.h"
#include "moecore/ckpt/state_dict.h"
#include "moecore/ckpt/upcycling.h"
#include "moecore/model/gpt_model.h"
#include "moecore/ops/optim.h"
#include "unit/test_temp_dir.h"

namespace moecore {
namespace {

constexpr int64_t kB = 2, kS = 8, kV = 96;

// A MoE model whose layer 0 is dense and layer 1 has E=4 experts of width 48 / g, top-2.
ModelConfig moe_config(const int64_t g, const Activation activation, const bool bias) {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.ffn_hidden_size = 48;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.kv_channels = 8;
  c.seq_length = kS;
  c.max_position_embeddings = kS;
  c.vocab_size = kV;
  c.normalization = Normalization::kRMSNorm;
  c.activation = activation;
  c.add_bias_linear = bias;
  c.position_embedding_type = PositionEmbedding::kRope;
  c.init_method_std = 0.2;  // large enough that the MLPs move the loss visibly
  c.attention_dropout = 0.0;
  c.hidden_dropout = 0.0;
  c.untie_embeddings_and_output_weights = true;
  c.moe.num_experts = 4;
  c.moe.topk = 2;
  c.moe.ffn_hidden_size = 48 / g;
  c.moe.moe_layer_pattern = {false, true};
  c.moe.load_balancing_types = {LoadBalancingType::kAuxLoss};
  c.moe.aux_loss_coeffs = {0.01};
  return c;
}

struct Batch {
  std::vector<int32_t> tokens_BS, labels_BS;
};

Batch fixed_batch() {
  std::mt19937 gen(3);
  std::uniform_int_distribution<int32_t> id(0, kV - 1);
  Batch b;
  for (int64_t i = 0; i < kB * kS; ++i) {
    b.tokens_BS.push_back(id(gen));
    b.labels_BS.push_back(id(gen));
  }
  return b;
}

double eval_loss(GPTModel& model, const Batch& b) {
  std::unique_ptr<MicroBatchContext> ctx;
  return model.forward(ctx, b.tokens_BS.data(), b.labels_BS.data(), nullptr, kB, kS, ForwardOptions{.training = false});
}

// Every parameter and buffer of `model` as whole global tensors (a one-process dense "checkpoint").
std::unique_ptr<GlobalTensorSource> source_of(const GPTModel& model) {
  auto source = std::make_unique<GlobalTensorSource>("dense model");
  for (const Param& p : model.params()) source->add_tensor(p.name, p.value.clone());
  for (const Buffer& b : model.named_buffers()) source->add_tensor(b.name, b.value.clone());
  return source;
}

void load(const StateSource& source, GPTModel& model) {
  StateDict state;
  add_model_state(state, model);
  load_state(source, state);
}

// Upcycles a fresh dense model of dense_config_for_upcycling(moe, g) into `moe`, checks the iteration-0 loss.
void expect_same_loss_after_upcycling(const ModelConfig& moe, const int64_t g) {
  const ModelConfig dense_config = dense_config_for_upcycling(moe, g);
  EXPECT_FALSE(dense_config.moe.enabled());
  EXPECT_EQ(dense_config.ffn_hidden_size, moe.moe.ffn_hidden_size * g);
  GPTModel dense(dense_config, 11);
  const std::unique_ptr<GlobalTensorSource> dense_source = source_of(dense);
  const uint64_t seed = 5;
  const std::unique_ptr<GlobalTensorSource> upcycled =
      upcycled_state_source(*dense_source, moe, g, seed, moe.init_method_std);
  std::vector<std::string> keys;
  for (const ModelStateKey& k : model_state_keys(moe)) keys.push_back(k.key);
  EXPECT_EQ(upcycled->keys(), keys);

  GPTModel upcycled_model(moe, seed);
  const Batch batch = fixed_batch();
  const double random_moe_loss = eval_loss(upcycled_model, batch);
  load(*upcycled, upcycled_model);
  const double dense_loss = eval_loss(dense, batch);
  const double moe_loss = eval_loss(upcycled_model, batch);
  EXPECT_NEAR(moe_loss, dense_loss, 1e-6 * dense_loss) << "g=" << g;
  // The check has teeth: the MoE model's own init is far from the dense model.
  EXPECT_GT(std::abs(random_moe_loss - dense_loss), 1e-2 * dense_loss);

  // The router: the MoE model's own init (seed 5) with its first E/g rows each repeated g times.
  const GPTModel own(moe, seed);
  const Tensor& own_router = own.param("decoder.layers.1.mlp.router.weight").value;
  const Tensor& router = upcycled_model.param("decoder.layers.1.mlp.router.weight").value;
  const int64_t H = moe.hidden_size;
  for (int64_t e = 0; e < moe.moe.num_experts; ++e) {
    for (int64_t h = 0; h < H; ++h) {
      ASSERT_EQ(router.data<float>()[e * H + h], own_router.data<float>()[(e / g) * H + h]) << e << " " << h;
    }
  }
  // The dense layer 0 copies the dense MLP; the attention of the MoE layer is the dense one.
  for (const std::string name :
       {"decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.self_attention.linear_qkv.weight"}) {
    const Tensor& a = dense.param(name).value;
    const Tensor& b = upcycled_model.param(name).value;
    for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.data<float>()[i], b.data<float>()[i]) << name;
  }
}

TEST(Upcycling, CoarseUpcyclingKeepsTheDenseLoss) {
  expect_same_loss_after_upcycling(moe_config(1, Activation::kSwiGLU, /*bias=*/true), 1);
}

TEST(Upcycling, FineGrainedPiecesTogetherAreTheDenseFfn) {
  expect_same_loss_after_upcycling(moe_config(2, Activation::kSquaredReLU, /*bias=*/false), 2);
}

// Expert weights against index formulas: SwiGLU g=2 pieces re-paired, post-softmax s = 2^(1/3); pre-softmax g=1
// s = (E*g/topk)^(1/3) = 2^(1/3); GeLU g=2 s = 2^(1/2), fc2 columns.
TEST(Upcycling, ExpertPiecesAndScales) {
  struct Case {
    int64_t g;
    Activation activation;
    bool pre_softmax;
    double scale;
  };
  for (const Case& k :
       {Case{2, Activation::kSwiGLU, false, std::cbrt(2.0)}, Case{1, Activation::kSwiGLU, true, std::cbrt(4.0 * 1 / 2)},
        Case{2, Activation::kGelu, false, std::sqrt(2.0)}}) {
    SCOPED_TRACE("g=" + std::to_string(k.g) + (k.pre_softmax ? " pre-softmax" : ""));
    ModelConfig moe = moe_config(k.g, k.activation, /*bias=*/true);
    moe.moe.pre_softmax = k.pre_softmax;
    GPTModel dense(dense_config_for_upcycling(moe, k.g), 11);
    const std::unique_ptr<GlobalTensorSource> dense_source = source_of(dense);
    const std::unique_ptr<GlobalTensorSource> upcycled = upcycled_state_source(*dense_source, moe, k.g, 5, 0.2);
    const auto s = static_cast<float>(k.scale);
    const int64_t H = moe.hidden_size, F = 48, block = F / k.g;
    const bool swiglu = k.activation == Activation::kSwiGLU;
    const Tensor& fc1 = dense.param("decoder.layers.1.mlp.linear_fc1.weight").value;
    const Tensor& fc1_bias = dense.param("decoder.layers.1.mlp.linear_fc1.bias").value;
    const Tensor& fc2 = dense.param("decoder.layers.1.mlp.linear_fc2.weight").value;
    const Tensor& fc2_bias = dense.param("decoder.layers.1.mlp.linear_fc2.bias").value;
    for (int64_t e = 0; e < 4; ++e) {
      const std::string expert = "decoder.layers.1.mlp.experts.local_experts." + std::to_string(e) + ".";
      const int64_t j = e % k.g;
      const Tensor w1 = read_global_tensor(*upcycled, expert + "linear_fc1.weight");
      const Tensor b1 = read_global_tensor(*upcycled, expert + "linear_fc1.bias");
      const Tensor w2 = read_global_tensor(*upcycled, expert + "linear_fc2.weight");
      const Tensor b2 = read_global_tensor(*upcycled, expert + "linear_fc2.bias");
      ASSERT_EQ(w1.dim(0), (swiglu ? 2 : 1) * block);
      for (int64_t r = 0; r < w1.dim(0); ++r) {
        // SwiGLU: rows [0, block) are the gate half's block j, rows [block, 2 block) the up half's block j.
        const int64_t dense_row = r < block ? j * block + r : F + j * block + (r - block);
        for (int64_t h = 0; h < H; ++h) {
          ASSERT_EQ(w1.data<float>()[r * H + h], fc1.data<float>()[dense_row * H + h] * s) << e << " " << r;
        }
        ASSERT_EQ(b1.data<float>()[r], fc1_bias.data<float>()[dense_row] * s);
      }
      ASSERT_EQ(w2.shape(), (std::vector<int64_t>{H, block}));
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t c = 0; c < block; ++c) {
          ASSERT_EQ(w2.data<float>()[h * block + c], fc2.data<float>()[h * F + j * block + c] * s);
        }
        ASSERT_EQ(b2.data<float>()[h], fc2_bias.data<float>()[h]);  // unscaled, every expert
      }
    }
  }
}

TEST(Upcycling, ExpertBiasBufferStartsAtZeroAndRouterBiasKeepsItsInit) {
  ModelConfig moe = moe_config(1, Activation::kSwiGLU, /*bias=*/true);
  moe.moe.enable_expert_bias = true;
  moe.moe.score_function = RouterScoreFunction::kSigmoid;
  GPTModel dense(dense_config_for_upcycling(moe, 1), 11);
  const std::unique_ptr<GlobalTensorSource> dense_source = source_of(dense);
  GPTModel model(moe, 8);
  for (Buffer& b : model.named_buffers()) {
    for (float& v : b.value.span<float>()) v = 1.0f;
  }
  load(*upcycled_state_source(*dense_source, moe, 1, 8, moe.init_method_std), model);
  for (const float v : model.buffer("decoder.layers.1.mlp.router.expert_bias").value.span<float>()) EXPECT_EQ(v, 0.0f);
  const GPTModel own(moe, 8);
  const Tensor& bias = model.param("decoder.layers.1.mlp.router.bias").value;
  const Tensor& own_bias = own.param("decoder.layers.1.mlp.router.bias").value;
  for (int64_t e = 0; e < 4; ++e) EXPECT_EQ(bias.data<float>()[e], own_bias.data<float>()[e]);
}

TEST(Upcycling, AdamWStepsLowerTheLoss) {
  const ModelConfig moe = moe_config(1, Activation::kSwiGLU, /*bias=*/false);
  GPTModel dense(dense_config_for_upcycling(moe, 1), 11);
  const std::unique_ptr<GlobalTensorSource> dense_source = source_of(dense);
  GPTModel model(moe, 5);
  load(*upcycled_state_source(*dense_source, moe, 1, 5, moe.init_method_std), model);
  const Batch batch = fixed_batch();
  const double before = eval_loss(model, batch);
  std::vector<Tensor> exp_avg, exp_avg_sq;
  for (const Param& p : model.params()) {
    exp_avg.push_back(Tensor::zeros(p.value.shape(), DType::kF32));
    exp_avg_sq.push_back(Tensor::zeros(p.value.shape(), DType::kF32));
  }
  for (int64_t step = 1; step <= 5; ++step) {
    model.zero_grad();
    std::unique_ptr<MicroBatchContext> ctx;
    model.forward(ctx, batch.tokens_BS.data(), batch.labels_BS.data(), nullptr, kB, kS, ForwardOptions{});
    model.backward(std::move(ctx), 1.0);
    for (size_t i = 0; i < model.params().size(); ++i) {
      Param& p = model.params()[i];
      ops::adamw_step(p.value, p.grad, exp_avg[i], exp_avg_sq[i], ops::AdamWHyper{.lr = 1e-2, .step = step});
    }
  }
  const double after = eval_loss(model, batch);
  EXPECT_LT(after, before - 0.05) << before << " -> " << after;
}

TEST(Upcycling, BadSettingsGiveOneLineErrors) {
  const ModelConfig moe = moe_config(1, Activation::kSwiGLU, false);
  test::expect_error_containing<ConfigError>([&] { dense_config_for_upcycling(moe, 3); },
                                             "--moe-upcycling-granularity 3 does not divide --num-experts 4");
  test::expect_error_containing<ConfigError>([&] { dense_config_for_upcycling(moe, 0); },
                                             "--moe-upcycling-granularity must be a positive integer, got 0");
  ModelConfig shared = moe;
  shared.moe.shared_expert_intermediate_size = 16;
  test::expect_error_containing<ConfigError>([&] { dense_config_for_upcycling(shared, 1); }, "shared experts");
  ModelConfig dense_only = moe;
  dense_only.moe = MoEConfig{};
  test::expect_error_containing<ConfigError>([&] { dense_config_for_upcycling(dense_only, 1); }, "--num-experts");
  // Dense layers copy the dense MLP, so their width must be the dense model's.
  test::expect_error_containing<ConfigError>(
      [&] { dense_config_for_upcycling(moe_config(2, Activation::kSwiGLU, false), 1); },
      "--ffn-hidden-size 48 of the dense layer 0");

  // A dense checkpoint of width 48 upcycled into experts of width 24 with granularity 1: the split says 2.
  GPTModel dense(dense_config_for_upcycling(moe, 1), 11);
  const std::unique_ptr<GlobalTensorSource> dense_source = source_of(dense);
  ModelConfig narrow = moe;
  narrow.moe.ffn_hidden_size = 24;
  narrow.moe.moe_layer_pattern = {true, true};
  try {
    upcycled_state_source(*dense_source, narrow, 1, 5, 0.2);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "the dense checkpoint's FFN hidden size 48 is not --moe-ffn-hidden-size 24 x "
              "--moe-upcycling-granularity 1 (it gives granularity 2)");
  }
}

}  // namespace
}  // namespace moecore
