// MoEConfig: the --moe-layer-freq parser (expected patterns written out by hand from Python's evaluation of the same
// expressions) and one clear error per inconsistent setting (Megatron's asserts in validate_args,
// TransformerConfig.__post_init__, the router and the experts).
#include "moecore/moe/moe_config.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moecore/model/config.h"

namespace moecore {
namespace {

std::vector<bool> bits(const std::vector<int>& values) {
  std::vector<bool> result;
  for (const int value : values) result.push_back(value == 1);
  return result;
}

std::string parse_error(const std::string& text, const int64_t num_layers) {
  try {
    parse_moe_layer_freq(text, num_layers);
  } catch (const ConfigError& error) {
    return error.what();
  }
  return "<no error>";
}

TEST(MoELayerFreq, IntegerForm) {
  // Megatron: layer i is MoE iff i % N == 0.
  EXPECT_EQ(parse_moe_layer_freq("1", 4), bits({1, 1, 1, 1}));
  EXPECT_EQ(parse_moe_layer_freq("2", 5), bits({1, 0, 1, 0, 1}));
  EXPECT_EQ(parse_moe_layer_freq("3", 7), bits({1, 0, 0, 1, 0, 0, 1}));
  EXPECT_EQ(parse_moe_layer_freq(" +4 ", 3), bits({1, 0, 0}));  // Python's int() accepts these
  EXPECT_EQ(parse_moe_layer_freq("10", 2), bits({1, 0}));
}

TEST(MoELayerFreq, ListForms) {
  EXPECT_EQ(parse_moe_layer_freq("[1,0,1,0]", 4), bits({1, 0, 1, 0}));
  EXPECT_EQ(parse_moe_layer_freq("[1,0,1,0,]", 4), bits({1, 0, 1, 0}));  // trailing comma, as Python
  EXPECT_EQ(parse_moe_layer_freq("([0]*3+[1]*9)", 12), bits({0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(parse_moe_layer_freq("([0]+[1]*5)", 6), bits({0, 1, 1, 1, 1, 1}));
  // Megatron's help examples: ([1]*3+[0]*1)*3 and ([1]*3+[0]*2)*2.
  EXPECT_EQ(parse_moe_layer_freq("([1]*3+[0]*1)*3", 12), bits({1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0}));
  EXPECT_EQ(parse_moe_layer_freq("([1]*3+[0]*2)*2", 10), bits({1, 1, 1, 0, 0, 1, 1, 1, 0, 0}));
  // int * list, arithmetic inside counts, precedence (* before +), unary plus, spaces, [] and *0.
  EXPECT_EQ(parse_moe_layer_freq("2*[0,1]", 4), bits({0, 1, 0, 1}));
  EXPECT_EQ(parse_moe_layer_freq("[1]*(1+2)+[0]*2*1", 5), bits({1, 1, 1, 0, 0}));
  EXPECT_EQ(parse_moe_layer_freq("[0]+[1]*2*2", 5), bits({0, 1, 1, 1, 1}));
  EXPECT_EQ(parse_moe_layer_freq("[+1, 0] * 2", 4), bits({1, 0, 1, 0}));
  EXPECT_EQ(parse_moe_layer_freq("[]+[1]*0+[1,1,0]", 3), bits({1, 1, 0}));
  EXPECT_EQ(parse_moe_layer_freq("[(1)]*2", 2), bits({1, 1}));
}

TEST(MoELayerFreq, BadText) {
  EXPECT_EQ(parse_error("abc", 4),
            "invalid --moe-layer-freq 'abc': expected an integer N or a list expression such as ([0]*3+[1]*9)");
  EXPECT_EQ(parse_error("", 4),
            "invalid --moe-layer-freq '': expected an integer N or a list expression such as ([0]*3+[1]*9)");
  EXPECT_EQ(parse_error("0", 4), "invalid --moe-layer-freq '0': the frequency must be a positive integer");
  EXPECT_EQ(parse_error("-2", 4), "invalid --moe-layer-freq '-2': the frequency must be a positive integer");
  EXPECT_EQ(parse_error("[1,0", 2), "invalid --moe-layer-freq '[1,0': expected ']' at the end");
  EXPECT_EQ(parse_error("[1,0]]", 2), "invalid --moe-layer-freq '[1,0]]': unexpected ']' at position 5");
  EXPECT_EQ(parse_error("[1,x]", 2), "invalid --moe-layer-freq '[1,x]': unexpected 'x' at position 3");
  EXPECT_EQ(parse_error("[1]-[0]", 2), "invalid --moe-layer-freq '[1]-[0]': unexpected '-' at position 3");
  EXPECT_EQ(parse_error("[1]*", 2), "invalid --moe-layer-freq '[1]*': expression ends early");
  EXPECT_EQ(parse_error("[1]+1", 2), "invalid --moe-layer-freq '[1]+1': cannot add a list and a number");
  EXPECT_EQ(parse_error("[1]*[2]", 2), "invalid --moe-layer-freq '[1]*[2]': cannot multiply two lists");
  EXPECT_EQ(parse_error("[[1],[0]]", 2), "invalid --moe-layer-freq '[[1],[0]]': nested lists are not a layer pattern");
  EXPECT_EQ(parse_error("([1],[0])", 2),
            "invalid --moe-layer-freq '([1],[0])': tuples are not a layer pattern (use a list: [...])");
  EXPECT_EQ(parse_error("[1,2]", 2), "invalid --moe-layer-freq '[1,2]': entries must be 0 (dense) or 1 (MoE), found 2");
  EXPECT_EQ(parse_error("([1]*3)[0]", 3), "invalid --moe-layer-freq '([1]*3)[0]': unexpected '[' at position 7");
  EXPECT_EQ(parse_error("[1]*99999999999", 2), "invalid --moe-layer-freq '[1]*99999999999': pattern too long");
  EXPECT_EQ(parse_error("[1]*99999999999999999999", 2),
            "invalid --moe-layer-freq '[1]*99999999999999999999': number too large");
}

TEST(MoELayerFreq, WrongLength) {
  EXPECT_EQ(parse_error("([0]*3+[1]*9)", 4),
            "invalid --moe-layer-freq '([0]*3+[1]*9)': the pattern has 12 entries but --num-layers is 4");
  EXPECT_EQ(parse_error("[1,0,1]", 4),
            "invalid --moe-layer-freq '[1,0,1]': the pattern has 3 entries but --num-layers is 4");
  EXPECT_EQ(parse_error("[]", 1), "invalid --moe-layer-freq '[]': the pattern has 0 entries but --num-layers is 1");
}

// A valid MoE configuration for 4 layers; each test breaks one thing.
MoEConfig valid_config() {
  MoEConfig config;
  config.num_experts = 8;
  config.ffn_hidden_size = 32;
  config.moe_layer_pattern = bits({0, 1, 1, 1});
  config.topk = 2;
  return config;
}

std::string validate_error(const MoEConfig& config, const int64_t num_layers = 4) {
  try {
    config.validate(num_layers);
  } catch (const ConfigError& error) {
    return error.what();
  }
  return "<no error>";
}

TEST(MoEConfigValidate, ValidConfigsPass) {
  EXPECT_EQ(validate_error(valid_config()), "<no error>");
  MoEConfig dense;  // num_experts == 0: nothing else is checked
  dense.topk = 100;
  EXPECT_EQ(validate_error(dense), "<no error>");
  EXPECT_FALSE(dense.enabled());
  EXPECT_FALSE(dense.is_moe_layer(0));

  // A DeepSeek-V3-like router: sigmoid, groups, expert bias, scaling, seq_aux_loss, shared expert with gate.
  MoEConfig deepseek = valid_config();
  deepseek.num_experts = 16;
  deepseek.topk = 4;
  deepseek.score_function = RouterScoreFunction::kSigmoid;
  deepseek.num_groups = 4;
  deepseek.group_topk = 2;
  deepseek.enable_expert_bias = true;
  deepseek.topk_scaling_factor = 2.5;
  deepseek.load_balancing_types = {LoadBalancingType::kSeqAuxLoss};
  deepseek.aux_loss_coeffs = {1e-4};
  deepseek.shared_expert_intermediate_size = 64;
  deepseek.shared_expert_gate = true;
  EXPECT_EQ(validate_error(deepseek), "<no error>");
  EXPECT_TRUE(deepseek.is_moe_layer(1));
  EXPECT_FALSE(deepseek.is_moe_layer(0));
  EXPECT_FALSE(deepseek.is_moe_layer(4));

  // Top-1 with pre-softmax, capacity with padding and the position policy, apply-probs-on-input.
  MoEConfig switch_like = valid_config();
  switch_like.topk = 1;
  switch_like.pre_softmax = true;
  switch_like.capacity_factor = 1.25;
  switch_like.pad_expert_input_to_capacity = true;
  switch_like.drop_policy = TokenDropPolicy::kPosition;
  switch_like.apply_probs_on_input = true;
  EXPECT_EQ(validate_error(switch_like), "<no error>");

  // Top-1 sinkhorn needs no pre-softmax; a list of types with one coefficient each.
  MoEConfig sinkhorn = valid_config();
  sinkhorn.topk = 1;
  sinkhorn.load_balancing_types = {LoadBalancingType::kSinkhorn};
  EXPECT_EQ(validate_error(sinkhorn), "<no error>");
  MoEConfig two_losses = valid_config();
  two_losses.load_balancing_types = {LoadBalancingType::kAuxLoss, LoadBalancingType::kGlobalAuxLoss};
  two_losses.aux_loss_coeffs = {1e-2, 1e-3};
  EXPECT_EQ(validate_error(two_losses), "<no error>");
}

TEST(MoEConfigValidate, ExpertCountAndSizes) {
  MoEConfig config = valid_config();
  config.num_experts = -1;
  EXPECT_EQ(validate_error(config), "--num-experts must be positive, or 0 for a dense model (got -1)");
  config = valid_config();
  config.ffn_hidden_size = 0;
  EXPECT_EQ(validate_error(config), "--moe-ffn-hidden-size must be positive (got 0)");
  config = valid_config();
  EXPECT_EQ(validate_error(config, 5), "--moe-layer-freq pattern has 4 entries but --num-layers is 5");
  config.shared_expert_intermediate_size = -8;
  EXPECT_EQ(validate_error(config), "--moe-shared-expert-intermediate-size must be positive (got -8)");
  config = valid_config();
  config.shared_expert_gate = true;
  EXPECT_EQ(validate_error(config), "--moe-shared-expert-gate requires --moe-shared-expert-intermediate-size");
  config = valid_config();
  config.shared_expert_overlap = true;
  config.dispatcher_type = TokenDispatcherType::kAllToAll;
  EXPECT_EQ(validate_error(config), "--moe-shared-expert-overlap requires --moe-shared-expert-intermediate-size");
  config.shared_expert_intermediate_size = 16;
  EXPECT_EQ(validate_error(config), "<no error>");
  config.dispatcher_type = TokenDispatcherType::kAllGather;
  EXPECT_EQ(validate_error(config), "moe_shared_expert_overlap only works with alltoall or flex token dispatcher.");
}

TEST(MoEConfigValidate, RouterTopkAndScores) {
  MoEConfig config = valid_config();
  config.topk = 9;
  EXPECT_EQ(validate_error(config), "--moe-router-topk (9) must not exceed --num-experts (8)");
  config.topk = 0;
  EXPECT_EQ(validate_error(config), "--moe-router-topk must be positive (got 0)");
  config.topk = 1;
  EXPECT_EQ(validate_error(config), "--moe-router-topk 1 with softmax scores requires --moe-router-pre-softmax");
  config.score_function = RouterScoreFunction::kSigmoid;
  EXPECT_EQ(validate_error(config), "<no error>");  // sigmoid top-1 keeps the raw score: fine
  config.pre_softmax = true;  // Megatron ignores it for sigmoid scores (DeepSeek-V3 recipes pass both)
  EXPECT_EQ(validate_error(config), "<no error>");
  config = valid_config();
  config.topk_scaling_factor = 0.0;
  EXPECT_EQ(validate_error(config), "--moe-router-topk-scaling-factor must be positive (got 0.000000)");
  config = valid_config();
  config.input_jitter_eps = -0.1;
  EXPECT_EQ(validate_error(config), "--moe-input-jitter-eps must be in [0, 1) (got -0.100000)");
}

TEST(MoEConfigValidate, GroupLimitedRouting) {
  MoEConfig config = valid_config();
  config.num_groups = 3;
  config.group_topk = 1;
  EXPECT_EQ(validate_error(config), "--num-experts (8) must be divisible by --moe-router-num-groups (3)");
  config.num_groups = 4;
  config.group_topk = 5;
  EXPECT_EQ(validate_error(config), "--moe-router-group-topk (5) must not exceed --moe-router-num-groups (4)");
  config.group_topk = 0;
  EXPECT_EQ(validate_error(config), "--moe-router-num-groups requires --moe-router-group-topk");
  config.num_groups = 0;
  config.group_topk = 2;
  EXPECT_EQ(validate_error(config), "--moe-router-group-topk requires --moe-router-num-groups");
  config.num_groups = -4;
  EXPECT_EQ(validate_error(config), "--moe-router-num-groups must be positive (got -4)");
  // 8 experts in 4 groups of 2; keeping 1 group leaves 2 experts, fewer than top-3.
  config = valid_config();
  config.topk = 3;
  config.num_groups = 4;
  config.group_topk = 1;
  EXPECT_EQ(validate_error(config),
            "--moe-router-topk (3) exceeds the 2 experts in the --moe-router-group-topk (1) "
            "kept groups");
  config.group_topk = 2;  // topk 3 is not a multiple of group_topk 2: Megatron uses topk // group_topk
  EXPECT_EQ(validate_error(config), "<no error>");
  config.topk = 1;
  config.score_function = RouterScoreFunction::kSigmoid;
  EXPECT_EQ(validate_error(config),
            "--moe-router-topk (1) must be at least --moe-router-group-topk (2): groups are scored by their "
            "top-(topk // group_topk) experts");
}

TEST(MoEConfigValidate, ExpertBias) {
  MoEConfig config = valid_config();
  config.enable_expert_bias = true;
  EXPECT_EQ(
      validate_error(config),
      "--moe-router-enable-expert-bias requires --moe-router-score-function sigmoid or sqrtsoftplus (got softmax)");
  config.score_function = RouterScoreFunction::kSqrtSoftplus;
  EXPECT_EQ(validate_error(config), "<no error>");
  config.bias_update_rate = -1e-3;
  EXPECT_EQ(validate_error(config), "--moe-router-bias-update-rate must be non-negative (got -0.001000)");
}

TEST(MoEConfigValidate, LoadBalancingLosses) {
  MoEConfig config = valid_config();
  config.load_balancing_types = {LoadBalancingType::kAuxLoss, LoadBalancingType::kSeqAuxLoss};
  EXPECT_EQ(validate_error(config),
            "--moe-aux-loss-coeff has 1 value(s) but --moe-router-load-balancing-type has 2 type(s): give one "
            "coefficient per type");
  config = valid_config();
  config.aux_loss_coeffs = {1e-2, 1e-3};
  EXPECT_EQ(validate_error(config),
            "--moe-aux-loss-coeff has 2 value(s) but --moe-router-load-balancing-type has 1 type(s): give one "
            "coefficient per type");
  config = valid_config();
  config.load_balancing_types = {LoadBalancingType::kSinkhorn};
  config.aux_loss_coeffs = {1e-2};
  EXPECT_EQ(validate_error(config),
            "--moe-router-load-balancing-type sinkhorn does not use an auxiliary loss: its --moe-aux-loss-coeff must "
            "be 0 (got 0.010000)");
  config.load_balancing_types = {LoadBalancingType::kAuxLoss, LoadBalancingType::kSinkhorn};
  config.aux_loss_coeffs = {1e-2, 0.0};
  EXPECT_EQ(validate_error(config), "<no error>");
  config.load_balancing_types = {};
  config.aux_loss_coeffs = {};
  EXPECT_EQ(validate_error(config), "--moe-router-load-balancing-type needs at least one type");
  config = valid_config();
  config.aux_loss_coeffs = {-1.0};
  EXPECT_EQ(validate_error(config), "--moe-aux-loss-coeff must be non-negative (got -1.000000)");
  config = valid_config();
  config.z_loss_coeff = -1e-3;
  EXPECT_EQ(validate_error(config), "--moe-z-loss-coeff must be non-negative (got -0.001000)");
}

TEST(MoEConfigValidate, CapacityAndProbs) {
  MoEConfig config = valid_config();
  config.pad_expert_input_to_capacity = true;
  EXPECT_EQ(validate_error(config), "--moe-pad-expert-input-to-capacity requires --moe-expert-capacity-factor");
  config.capacity_factor = 0.0;
  EXPECT_EQ(validate_error(config),
            "--moe-expert-capacity-factor must be positive (a negative value means dropless; got 0.000000)");
  config = valid_config();
  config.capacity_factor = 1.0;
  config.load_balancing_types = {LoadBalancingType::kSinkhorn};
  EXPECT_EQ(validate_error(config),
            "--moe-expert-capacity-factor works only with aux_loss, seq_aux_loss, global_aux_loss or none load "
            "balancing (got sinkhorn)");
  config = valid_config();
  config.apply_probs_on_input = true;
  EXPECT_EQ(validate_error(config), "--moe-apply-probs-on-input requires --moe-router-topk 1 (got 2)");
}

TEST(MoEConfigValidate, Names) {
  EXPECT_EQ(to_string(RouterScoreFunction::kSoftmax), "softmax");
  EXPECT_EQ(to_string(RouterScoreFunction::kSigmoid), "sigmoid");
  EXPECT_EQ(to_string(RouterScoreFunction::kSqrtSoftplus), "sqrtsoftplus");
  EXPECT_EQ(to_string(LoadBalancingType::kAuxLoss), "aux_loss");
  EXPECT_EQ(to_string(LoadBalancingType::kSeqAuxLoss), "seq_aux_loss");
  EXPECT_EQ(to_string(LoadBalancingType::kGlobalAuxLoss), "global_aux_loss");
  EXPECT_EQ(to_string(LoadBalancingType::kSinkhorn), "sinkhorn");
  EXPECT_EQ(to_string(LoadBalancingType::kNone), "none");
}

}  // namespace
}  // namespace moecore
