// The planner's FLOPs model against Megatron's own formula. The expected values of the real models come from
// Megatron-LM commit d98e8a64ddf34856e74b24714e3bedb2f5a39553, megatron/training/training.py
// num_floating_point_operations, run by tests/unit/data/megatron_flops_reference.py (which lists every args field)
// with args.seq_length as stated, batch_size 1 for the per-token figure (divided by seq_length) and the global batch
// size for the per-step one; the tiny model's values are also worked out by hand below.
#include "moecore/plan/plan_flops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace moecore::plan {
namespace {

void expect_relative(const double actual, const double expected) {
  EXPECT_LE(std::abs(actual - expected), 1e-12 * std::abs(expected)) << actual << " vs " << expected;
}

std::vector<bool> pattern(const int64_t dense, const int64_t moe) {
  std::vector<bool> layers(static_cast<size_t>(dense), false);
  layers.insert(layers.end(), static_cast<size_t>(moe), true);
  return layers;
}

// Megatron args: num_layers 61, hidden_size 7168, ffn_hidden_size 18432, num_attention_heads 128, swiglu,
// multi_latent_attention, q_lora_rank 1536, kv_lora_rank 512, qk_head_dim 128, qk_pos_emb_head_dim 64,
// v_head_dim 128, num_experts 256, moe_layer_freq [0]*3+[1]*58, moe_ffn_hidden_size 2048, moe_router_topk 8,
// moe_shared_expert_intermediate_size 2048, padded_vocab_size 129280.
PlanModel deepseek_v3() {
  PlanModel model;
  ModelConfig& c = model.config;
  c.num_layers = 61;
  c.hidden_size = 7168;
  c.ffn_hidden_size = 18432;
  c.num_attention_heads = 128;
  c.num_query_groups = 128;
  c.kv_channels = 128;
  c.activation = Activation::kSwiGLU;
  c.seq_length = 4096;
  c.vocab_size = 129280;
  c.moe.num_experts = 256;
  c.moe.moe_layer_pattern = pattern(3, 58);
  c.moe.ffn_hidden_size = 2048;
  c.moe.topk = 8;
  c.moe.shared_expert_intermediate_size = 2048;
  c.mla = MlaConfig{
      .q_lora_rank = 1536, .kv_lora_rank = 512, .qk_head_dim = 128, .qk_pos_emb_head_dim = 64, .v_head_dim = 128};
  return model;
}

// Megatron args: num_layers 94, hidden_size 4096, ffn_hidden_size 12288, num_attention_heads 64,
// group_query_attention, num_query_groups 4, kv_channels 128, swiglu, num_experts 128, moe_layer_freq 1,
// moe_ffn_hidden_size 1536, moe_router_topk 8, no shared expert, padded_vocab_size 151936.
PlanModel qwen3_235b(const int64_t seq_length) {
  PlanModel model;
  ModelConfig& c = model.config;
  c.num_layers = 94;
  c.hidden_size = 4096;
  c.ffn_hidden_size = 12288;
  c.num_attention_heads = 64;
  c.num_query_groups = 4;
  c.kv_channels = 128;
  c.activation = Activation::kSwiGLU;
  c.seq_length = seq_length;
  c.vocab_size = 151936;
  c.moe.num_experts = 128;
  c.moe.moe_layer_pattern = pattern(0, 94);
  c.moe.ffn_hidden_size = 1536;
  c.moe.topk = 8;
  return model;
}

// Megatron args: num_layers 48, hidden_size 2048, ffn_hidden_size 6144, num_attention_heads 32,
// group_query_attention, num_query_groups 4, kv_channels 128, swiglu, num_experts 128, moe_layer_freq 1,
// moe_ffn_hidden_size 768, moe_router_topk 8, no shared expert, padded_vocab_size 151936.
PlanModel qwen3_30b_a3b() {
  PlanModel model;
  ModelConfig& c = model.config;
  c.num_layers = 48;
  c.hidden_size = 2048;
  c.ffn_hidden_size = 6144;
  c.num_attention_heads = 32;
  c.num_query_groups = 4;
  c.kv_channels = 128;
  c.activation = Activation::kSwiGLU;
  c.seq_length = 4096;
  c.vocab_size = 151936;
  c.moe.num_experts = 128;
  c.moe.moe_layer_pattern = pattern(0, 48);
  c.moe.ffn_hidden_size = 768;
  c.moe.topk = 8;
  return model;
}

// Megatron args: num_layers 32, hidden_size 4096, ffn_hidden_size 14336, num_attention_heads 32,
// group_query_attention, num_query_groups 8, kv_channels 128, swiglu, num_experts 8, moe_layer_freq 1,
// moe_ffn_hidden_size None (the experts take ffn_hidden_size), moe_router_topk 2, padded_vocab_size 32000.
PlanModel mixtral_8x7b() {
  PlanModel model;
  ModelConfig& c = model.config;
  c.num_layers = 32;
  c.hidden_size = 4096;
  c.ffn_hidden_size = 14336;
  c.num_attention_heads = 32;
  c.num_query_groups = 8;
  c.kv_channels = 128;
  c.activation = Activation::kSwiGLU;
  c.seq_length = 4096;
  c.vocab_size = 32000;
  c.moe.num_experts = 8;
  c.moe.moe_layer_pattern = pattern(0, 32);
  c.moe.ffn_hidden_size = 0;  // unset: --ffn-hidden-size
  c.moe.topk = 2;
  return model;
}

TEST(PlanFlops, DeepSeekV3AsMegatron) {
  const PlanModel model = deepseek_v3();
  expect_relative(flops_per_token(model), 249812054016.0);
  expect_relative(flops_per_step(model, 8192), 8.382301579260199e+18);
}

TEST(PlanFlops, DeepSeekV3WithMtpAsMegatron) {
  PlanModel model = deepseek_v3();
  model.config.mtp_num_layers = 1;  // Megatron args: mtp_num_layers 1
  expect_relative(flops_per_token(model), 259992950784.0);
  expect_relative(flops_per_step(model, 8192), 8.723915787561075e+18);
}

TEST(PlanFlops, Qwen3_235BAsMegatron) {
  expect_relative(flops_per_token(qwen3_235b(4096)), 148034813952.0);
  expect_relative(flops_per_step(qwen3_235b(4096), 2048), 1.2418060245962588e+18);
}

TEST(PlanFlops, Qwen3_235BLongContextAsMegatron) {
  expect_relative(flops_per_token(qwen3_235b(131072)), 734700503040.0);
  expect_relative(flops_per_step(qwen3_235b(131072), 1024), 9.86098322784859e+19);
}

TEST(PlanFlops, Qwen3_30BA3BAsMegatron) {
  expect_relative(flops_per_token(qwen3_30b_a3b()), 23006281728.0);
  expect_relative(flops_per_step(qwen3_30b_a3b(), 512), 4.824766973843866e+16);
}

TEST(PlanFlops, LatentMoEAsMegatron) {
  PlanModel model = qwen3_30b_a3b();
  model.config.moe.latent_size = 512;  // Megatron args: moe_latent_size 512
  expect_relative(flops_per_token(model), 15456534528.0);
  expect_relative(flops_per_step(model, 512), 3.2414702298464256e+16);
}

TEST(PlanFlops, Mixtral8x7BAsMegatron) {
  expect_relative(flops_per_token(mixtral_8x7b()), 79706456064.0);
  expect_relative(flops_per_step(mixtral_8x7b(), 256), 8.357827687376486e+16);
}

// Two layers (dense, then MoE), hidden 8, SwiGLU, dense ffn 16; MLA with 2 heads, q_lora 4, kv_lora 2, qk 3, rope 1,
// v 2; 4 experts of ffn 4, top-2, a shared expert of 4; vocabulary 10; 1 MTP layer; sequences of 4 tokens.
PlanModel tiny_mla_mtp() {
  PlanModel model;
  ModelConfig& c = model.config;
  c.num_layers = 2;
  c.hidden_size = 8;
  c.ffn_hidden_size = 16;
  c.num_attention_heads = 2;
  c.num_query_groups = 2;
  c.kv_channels = 4;
  c.activation = Activation::kSwiGLU;
  c.seq_length = 4;
  c.vocab_size = 10;
  c.moe.num_experts = 4;
  c.moe.moe_layer_pattern = {false, true};
  c.moe.ffn_hidden_size = 4;
  c.moe.topk = 2;
  c.moe.shared_expert_intermediate_size = 4;
  c.mla = MlaConfig{.q_lora_rank = 4, .kv_lora_rank = 2, .qk_head_dim = 3, .qk_pos_emb_head_dim = 1, .v_head_dim = 2};
  c.mtp_num_layers = 1;
  return model;
}

TEST(PlanFlops, TinyMlaWithMtpByHand) {
  // Megatron's formula by hand (3 * 2 = 6 for forward + backward and the FMA; the MTP layer is a third layer, of the
  // last layer's kind: 3 attention layers, 1 dense MLP, 2 MoE MLPs), per token:
  //   attention 6 * (q 4*(8 + 2*(3+1) + 1) = 68, kv 2*(8 + 2*(3+2) + 1) = 38, rope key 8*1 = 8, out 2*2*8 = 32)
  //             = 6 * 146 = 876 per layer, * 3 = 2628
  //   MLP 6*8 * (16*3*1 + 4*2*3*2 + 4*3*2) = 48 * 120 = 5760
  //   MTP norms and eh projection 6*1*(3*8 + 2*8*8) = 912; logits 6*8*10*(1 + 1) = 960
  //   sum 10260 per token; core attention 6 * (2*(3+1)/2 + 2*2/2) = 36 per layer, * 3 = 108 per unit of sum L^2.
  // One sequence of 4: 4 * 10260 + 16 * 108 = 42768, i.e. 10692 per token; 3 sequences: 12 * 10260 + 48 * 108.
  const PlanModel model = tiny_mla_mtp();
  EXPECT_DOUBLE_EQ(flops_per_token(model), 10692.0);
  EXPECT_DOUBLE_EQ(flops_per_step(model, 3), 128304.0);
  // Without q_lora_rank the queries come straight from the hidden state: q term 8*2*(3+1) = 64 instead of 68, so
  // 6 * 4 * 3 layers = 72 FLOPs less per token.
  PlanModel direct_queries = model;
  direct_queries.config.mla->q_lora_rank = 0;  // Megatron's None
  EXPECT_DOUBLE_EQ(flops_per_token(direct_queries), 10620.0);
  EXPECT_DOUBLE_EQ(flops_per_step(direct_queries, 3), 127440.0);
}

// The training log counts what the engine builds: a ModelConfig with multi-latent attention and MTP depths gives the
// hand-computed count above through train's flops_shape, as the planner's model does.
TEST(PlanFlops, TrainsShapeOfAnMlaMtpModelIsThePlannersCount) {
  const PlanModel model = tiny_mla_mtp();
  ModelConfig config = model.config;
  config.mla = MlaConfig{4, 2, 3, 1, 2, RopeType::kYarn};
  config.mtp_num_layers = 1;
  const FlopsShape shape = moecore::flops_shape(config);
  ASSERT_TRUE(shape.mla.has_value());
  EXPECT_EQ(shape.mla->q_lora_rank, 4);
  EXPECT_EQ(shape.mtp_num_layers, 1);
  EXPECT_DOUBLE_EQ(num_floating_point_operations(shape, 4.0, 16.0) / 4.0, 10692.0);
  config.mla->q_lora_rank = 0;  // queries from the hidden state (Megatron's None)
  EXPECT_EQ(moecore::flops_shape(config).mla->q_lora_rank, 0);
  EXPECT_DOUBLE_EQ(num_floating_point_operations(moecore::flops_shape(config), 4.0, 16.0) / 4.0, 10620.0);
}

TEST(PlanFlops, MtpLayerOfADenseLastLayerIsDense) {
  // The pattern reversed (MoE, then dense): the MTP layer now counts a dense MLP, 6*8*3*16 = 2304 per token, instead of
  // a MoE one, 6*8*(4*2*3 + 4*3) = 1728: 576 more per token.
  PlanModel model = tiny_mla_mtp();
  model.config.moe.moe_layer_pattern = {true, false};
  EXPECT_DOUBLE_EQ(flops_per_token(model), 10692.0 + 576.0);
}

TEST(PlanFlops, WithoutMlaOrMtpIsTrainsCount) {
  const PlanModel model = mixtral_8x7b();
  EXPECT_DOUBLE_EQ(flops_per_step(model, 256),
                   num_floating_point_operations(flops_shape(model.config), 256.0 * 4096, 256.0 * 4096 * 4096));
  const FlopsShape shape = flops_shape(model);
  EXPECT_EQ(shape.num_moe_layers, 32);
  EXPECT_TRUE(shape.last_layer_is_moe);
  EXPECT_EQ(shape.moe_ffn_hidden_size, 14336);  // Megatron's fallback to ffn_hidden_size
  EXPECT_FALSE(shape.mla.has_value());
  EXPECT_EQ(shape.mtp_num_layers, 0);
}

TEST(PlanFlops, BadInputIsAConfigError) {
  PlanModel model = tiny_mla_mtp();
  EXPECT_THROW(flops_per_step(model, 0), ConfigError);
  model.config.mtp_num_layers = -1;
  EXPECT_THROW(flops_per_token(model), ConfigError);
  model = tiny_mla_mtp();
  model.config.seq_length = 0;
  EXPECT_THROW(flops_per_token(model), ConfigError);
  model = tiny_mla_mtp();
  model.config.vocab_size = 0;
  EXPECT_THROW(flops_per_token(model), ConfigError);
  model = tiny_mla_mtp();
  model.config.mla->kv_lora_rank = 0;
  EXPECT_THROW(flops_per_token(model), ConfigError);
  model = tiny_mla_mtp();
  model.config.mla->q_lora_rank = -1;  // 0 is Megatron's None; below it is no shape
  EXPECT_THROW(flops_per_token(model), ConfigError);
}

}  // namespace
}  // namespace moecore::plan
