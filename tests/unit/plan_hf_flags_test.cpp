// megatron_flags_from_hf_config on the published config.json files of DeepSeek-V3, Qwen3-235B-A22B, Qwen3-30B-A3B
// and Mixtral-8x7B (tests/unit/data/hf_configs/, copied from the models' HuggingFace repositories). The expected
// lists are written by hand from those files and Megatron-Bridge's mapping (megatron/bridge/models/conversion/
// model_bridge.py CONFIG_MAPPING, deepseek/deepseek_v3_bridge.py, qwen/qwen3_moe_bridge.py).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "moecore/ckpt/hf_layout.h"
#include "moecore/config/arguments.h"
#include "moecore/model/config.h"
#include "moecore/plan/hf_flags.h"
#include "test_temp_dir.h"
#include "unit/test_source_dir.h"

namespace moecore::plan {
namespace {

namespace fs = std::filesystem;
using Flags = std::vector<std::string>;
using json = nlohmann::json;

// Repository root: $MOECORE_SOURCE_DIR, else three levels above this file (tests/unit/x.cpp).
using test::source_dir;

std::string fixture(const std::string& name) {
  return (source_dir() / "tests/unit/data/hf_configs" / (name + ".json")).string();
}

// `text` written to `name` in `dir`; returns the path.
std::string write_file(const test::TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir.path(name);
  std::ofstream(path) << text;
  return path;
}

// A fixture with some fields replaced (null removes one), written to `dir`.
std::string edited(const test::TempDir& dir, const std::string& name, const json& changes) {
  json j = read_json_file(fixture(name));
  for (const auto& [key, value] : changes.items()) {
    if (value.is_null()) {
      j.erase(key);
    } else {
      j[key] = value;
    }
  }
  return write_file(dir, "config.json", j.dump(2));
}

// The message of the ConfigError `path` gives (one line, naming the file).
std::string error_of(const std::string& path) {
  try {
    megatron_flags_from_hf_config(path);
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << message;
    return message;
  }
  ADD_FAILURE() << "no ConfigError for " << path;
  return "";
}

const Flags kDeepSeekV3 = {
    "--num-layers", "61", "--hidden-size", "7168", "--ffn-hidden-size", "18432", "--num-attention-heads", "128",
    // MLA: q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim.
    "--multi-latent-attention", "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128",
    "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128",
    // 129280 = 128 x 1010: Megatron's default divisor already pads nothing.
    "--max-position-embeddings", "163840", "--vocab-size", "129280", "--normalization", "RMSNorm", "--norm-epsilon",
    "1e-06", "--swiglu", "--disable-bias-linear", "--qk-layernorm", "--position-embedding-type", "rope",
    "--rotary-base", "10000", "--untie-embeddings-and-output-weights",
    // 256 routed experts of 2048, top-8, first_k_dense_replace 3 of 61 layers, one shared expert of 2048.
    "--num-experts", "256", "--moe-ffn-hidden-size", "2048", "--moe-router-topk", "8", "--moe-layer-freq",
    "([0]*3+[1]*58)", "--moe-shared-expert-intermediate-size", "2048",
    // scoring_func sigmoid, n_group 8, topk_group 4, routed_scaling_factor 2.5, topk_method noaux_tc.
    "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "8", "--moe-router-group-topk", "4",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-router-enable-expert-bias",
    // num_nextn_predict_layers 1.
    "--mtp-num-layers", "1"};

const Flags kQwen3_235B = {
    "--num-layers", "94", "--hidden-size", "4096", "--ffn-hidden-size", "12288", "--num-attention-heads", "64",
    "--group-query-attention", "--num-query-groups", "4", "--kv-channels", "128", "--max-position-embeddings", "40960",
    "--vocab-size", "151936", "--normalization", "RMSNorm", "--norm-epsilon", "1e-06", "--swiglu",
    "--disable-bias-linear", "--qk-layernorm", "--position-embedding-type", "rope", "--rotary-base", "1000000",
    "--untie-embeddings-and-output-weights",
    // Every layer MoE (decoder_sparse_step 1, no mlp_only_layers); norm_topk_prob true: no pre-softmax.
    "--num-experts", "128", "--moe-ffn-hidden-size", "1536", "--moe-router-topk", "8"};

const Flags kQwen3_30B = {"--num-layers",
                          "48",
                          "--hidden-size",
                          "2048",
                          "--ffn-hidden-size",
                          "6144",
                          "--num-attention-heads",
                          "32",
                          "--group-query-attention",
                          "--num-query-groups",
                          "4",
                          "--kv-channels",
                          "128",
                          "--max-position-embeddings",
                          "40960",
                          "--vocab-size",
                          "151936",
                          "--normalization",
                          "RMSNorm",
                          "--norm-epsilon",
                          "1e-06",
                          "--swiglu",
                          "--disable-bias-linear",
                          "--qk-layernorm",
                          "--position-embedding-type",
                          "rope",
                          "--rotary-base",
                          "1000000",
                          "--untie-embeddings-and-output-weights",
                          "--num-experts",
                          "128",
                          "--moe-ffn-hidden-size",
                          "768",
                          "--moe-router-topk",
                          "8"};

const Flags kMixtral8x7B = {
    // No head_dim in the file: --kv-channels stays hidden / heads = 128.
    "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
    "--group-query-attention", "--num-query-groups", "8", "--max-position-embeddings", "32768", "--vocab-size", "32000",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-05", "--swiglu", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--rotary-base", "1000000", "--untie-embeddings-and-output-weights",
    // Each expert is a full 14336-wide MLP; 8 experts top-2.
    "--num-experts", "8", "--moe-ffn-hidden-size", "14336", "--moe-router-topk", "2"};

TEST(PlanHfFlags, DeepSeekV3) { EXPECT_EQ(megatron_flags_from_hf_config(fixture("deepseek_v3")), kDeepSeekV3); }
TEST(PlanHfFlags, Qwen3_235B_A22B) {
  EXPECT_EQ(megatron_flags_from_hf_config(fixture("qwen3_235b_a22b")), kQwen3_235B);
}
TEST(PlanHfFlags, Qwen3_30B_A3B) { EXPECT_EQ(megatron_flags_from_hf_config(fixture("qwen3_30b_a3b")), kQwen3_30B); }
TEST(PlanHfFlags, Mixtral8x7B) { EXPECT_EQ(megatron_flags_from_hf_config(fixture("mixtral_8x7b")), kMixtral8x7B); }

// The flags `moecore train` knows parse into the model the config describes (MLA and MTP are the planner's own).
TEST(PlanHfFlags, TrainParsesTheFlags) {
  const std::set<std::string> planner_only = {
      "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank",  "--qk-head-dim",
      "--qk-pos-emb-head-dim",    "--v-head-dim",  "--mtp-num-layers"};
  const auto train_args = [&](const Flags& flags) {
    Flags out;
    for (size_t i = 0; i < flags.size(); ++i) {
      if (!planner_only.contains(flags[i])) {
        out.push_back(flags[i]);
      } else if (flags[i] != "--multi-latent-attention") {
        ++i;  // its value
      }
    }
    for (const char* flag : {"--seq-length", "4096", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
                             "--mock-data", "--tokenizer-type", "NullTokenizer"}) {
      out.push_back(flag);
    }
    return parse_train_args(out);
  };

  const TrainingArgs deepseek = train_args(megatron_flags_from_hf_config(fixture("deepseek_v3")));
  const ModelConfig& d = deepseek.model;
  EXPECT_EQ(d.num_layers, 61);
  EXPECT_EQ(d.ffn_hidden_size, 18432);
  EXPECT_EQ(d.moe.num_experts, 256);
  EXPECT_EQ(d.moe.shared_expert_intermediate_size, 2048);
  EXPECT_EQ(d.moe.score_function, RouterScoreFunction::kSigmoid);
  EXPECT_EQ(d.moe.num_groups, 8);
  EXPECT_EQ(d.moe.group_topk, 4);
  EXPECT_EQ(d.moe.topk_scaling_factor, 2.5);
  EXPECT_TRUE(d.moe.enable_expert_bias);
  ASSERT_EQ(d.moe.moe_layer_pattern.size(), 61u);
  EXPECT_FALSE(d.moe.moe_layer_pattern[2]);
  EXPECT_TRUE(d.moe.moe_layer_pattern[3]);
  EXPECT_EQ(d.norm_epsilon, 1e-6);
  EXPECT_TRUE(d.untie_embeddings_and_output_weights);
  EXPECT_FALSE(d.add_bias_linear);

  const TrainingArgs qwen = train_args(megatron_flags_from_hf_config(fixture("qwen3_235b_a22b")));
  EXPECT_EQ(qwen.model.num_query_groups, 4);
  EXPECT_EQ(qwen.model.kv_channels, 128);
  EXPECT_TRUE(qwen.model.qk_layernorm);
  EXPECT_EQ(qwen.model.rotary_base, 1e6);
  EXPECT_EQ(qwen.model.moe.ffn_hidden_size, 1536);
  EXPECT_FALSE(qwen.model.moe.pre_softmax);
  EXPECT_EQ(qwen.model.moe.moe_layer_pattern, std::vector<bool>(94, true));

  const TrainingArgs mixtral = train_args(megatron_flags_from_hf_config(fixture("mixtral_8x7b")));
  EXPECT_EQ(mixtral.model.num_query_groups, 8);
  EXPECT_EQ(mixtral.model.kv_channels, 128);
  EXPECT_EQ(mixtral.model.moe.topk, 2);
  EXPECT_EQ(mixtral.model.norm_epsilon, 1e-5);
}

// DeepSeek-V2-Lite's shape: no query compression, softmax routing without renormalization, two shared experts.
TEST(PlanHfFlags, DeepSeekV2Lite) {
  const test::TempDir dir("plan_hf_flags");
  const json v2_lite = {{"model_type", "deepseek_v2"},
                        {"hidden_act", "silu"},
                        {"num_hidden_layers", 27},
                        {"hidden_size", 2048},
                        {"intermediate_size", 10944},
                        {"moe_intermediate_size", 1408},
                        {"num_attention_heads", 16},
                        {"num_key_value_heads", 16},
                        {"q_lora_rank", nullptr},
                        {"kv_lora_rank", 512},
                        {"qk_nope_head_dim", 128},
                        {"qk_rope_head_dim", 64},
                        {"v_head_dim", 128},
                        {"n_routed_experts", 64},
                        {"n_shared_experts", 2},
                        {"num_experts_per_tok", 6},
                        {"first_k_dense_replace", 1},
                        {"moe_layer_freq", 1},
                        {"n_group", 1},
                        {"topk_group", 1},
                        {"topk_method", "greedy"},
                        {"scoring_func", "softmax"},
                        {"norm_topk_prob", false},
                        {"routed_scaling_factor", 1.0},
                        {"max_position_embeddings", 163840},
                        {"vocab_size", 102400},
                        {"rms_norm_eps", 1e-6},
                        {"rope_theta", 10000},
                        {"tie_word_embeddings", false}};
  const Flags expected = {"--num-layers",
                          "27",
                          "--hidden-size",
                          "2048",
                          "--ffn-hidden-size",
                          "10944",
                          "--num-attention-heads",
                          "16",
                          "--multi-latent-attention",
                          "--kv-lora-rank",
                          "512",
                          "--qk-head-dim",
                          "128",
                          "--qk-pos-emb-head-dim",
                          "64",
                          "--v-head-dim",
                          "128",
                          "--max-position-embeddings",
                          "163840",
                          "--vocab-size",
                          "102400",
                          "--normalization",
                          "RMSNorm",
                          "--norm-epsilon",
                          "1e-06",
                          "--swiglu",
                          "--disable-bias-linear",
                          "--qk-layernorm",
                          "--position-embedding-type",
                          "rope",
                          "--rotary-base",
                          "10000",
                          "--untie-embeddings-and-output-weights",
                          "--num-experts",
                          "64",
                          "--moe-ffn-hidden-size",
                          "1408",
                          "--moe-router-topk",
                          "6",
                          "--moe-layer-freq",
                          "([0]*1+[1]*26)",
                          "--moe-shared-expert-intermediate-size",
                          "2816",
                          "--moe-router-pre-softmax"};
  EXPECT_EQ(megatron_flags_from_hf_config(write_file(dir, "config.json", v2_lite.dump())), expected);
}

TEST(PlanHfFlags, QwenMoeLayerPattern) {
  const test::TempDir dir("plan_hf_flags");
  // decoder_sparse_step 2: layers 1, 3, 5, ... are MoE; mlp_only_layers turns layer 3 dense; norm_topk_prob false.
  const std::string path = edited(dir, "qwen3_30b_a3b",
                                  {{"num_hidden_layers", 6},
                                   {"decoder_sparse_step", 2},
                                   {"mlp_only_layers", json::array({3})},
                                   {"norm_topk_prob", false}});
  const Flags flags = megatron_flags_from_hf_config(path);
  const Flags tail(flags.end() - 9, flags.end());
  EXPECT_EQ(tail, (Flags{"--num-experts", "128", "--moe-ffn-hidden-size", "768", "--moe-router-topk", "8",
                         "--moe-layer-freq", "([0]*1+[1]*1+[0]*3+[1]*1)", "--moe-router-pre-softmax"}));
}

TEST(PlanHfFlags, DenseModels) {
  const test::TempDir dir("plan_hf_flags");
  // A Llama-3-8B-shaped config with tied embeddings and a vocabulary 128 does not divide (128257 is odd).
  const json llama = {{"model_type", "llama"},
                      {"hidden_act", "silu"},
                      {"num_hidden_layers", 32},
                      {"hidden_size", 4096},
                      {"intermediate_size", 14336},
                      {"num_attention_heads", 32},
                      {"num_key_value_heads", 8},
                      {"max_position_embeddings", 8192},
                      {"vocab_size", 128257},
                      {"rms_norm_eps", 1e-5},
                      {"rope_theta", 500000.0},
                      {"tie_word_embeddings", true},
                      {"attention_bias", false},
                      {"mlp_bias", false},
                      {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}}};
  EXPECT_EQ(megatron_flags_from_hf_config(write_file(dir, "config.json", llama.dump())),
            (Flags{"--num-layers",
                   "32",
                   "--hidden-size",
                   "4096",
                   "--ffn-hidden-size",
                   "14336",
                   "--num-attention-heads",
                   "32",
                   "--group-query-attention",
                   "--num-query-groups",
                   "8",
                   "--max-position-embeddings",
                   "8192",
                   "--vocab-size",
                   "128257",
                   "--make-vocab-size-divisible-by",
                   "1",
                   "--normalization",
                   "RMSNorm",
                   "--norm-epsilon",
                   "1e-05",
                   "--swiglu",
                   "--disable-bias-linear",
                   "--position-embedding-type",
                   "rope",
                   "--rotary-base",
                   "500000"}));

  // qwen3 dense: qk-layernorm, head_dim; transformers 5's rope_parameters holds rope_theta.
  const json qwen3 = {{"model_type", "qwen3"},
                      {"num_hidden_layers", 28},
                      {"hidden_size", 1024},
                      {"intermediate_size", 3072},
                      {"num_attention_heads", 16},
                      {"num_key_value_heads", 8},
                      {"head_dim", 128},
                      {"max_position_embeddings", 40960},
                      {"vocab_size", 151936},
                      {"rope_parameters", {{"rope_theta", 1000000}, {"rope_type", "default"}}},
                      {"tie_word_embeddings", true}};
  EXPECT_EQ(megatron_flags_from_hf_config(write_file(dir, "config.json", qwen3.dump())),
            (Flags{"--num-layers",
                   "28",
                   "--hidden-size",
                   "1024",
                   "--ffn-hidden-size",
                   "3072",
                   "--num-attention-heads",
                   "16",
                   "--group-query-attention",
                   "--num-query-groups",
                   "8",
                   "--kv-channels",
                   "128",
                   "--max-position-embeddings",
                   "40960",
                   "--vocab-size",
                   "151936",
                   "--normalization",
                   "RMSNorm",
                   "--swiglu",
                   "--disable-bias-linear",
                   "--qk-layernorm",
                   "--position-embedding-type",
                   "rope",
                   "--rotary-base",
                   "1000000"}));
}

TEST(PlanHfFlags, Errors) {
  const test::TempDir dir("plan_hf_flags");
  EXPECT_NE(error_of(edited(dir, "mixtral_8x7b", {{"model_type", "gpt2"}})).find("model_type 'gpt2' is not supported"),
            std::string::npos);
  EXPECT_NE(error_of(edited(dir, "qwen3_30b_a3b", {{"model_type", "qwen2_moe"}})).find("--add-qkv-bias"),
            std::string::npos);
  EXPECT_NE(
      error_of(edited(dir, "mixtral_8x7b", {{"num_local_experts", nullptr}})).find("missing field 'num_local_experts'"),
      std::string::npos);
  EXPECT_NE(error_of(edited(dir, "deepseek_v3", {{"kv_lora_rank", nullptr}})).find("missing field 'kv_lora_rank'"),
            std::string::npos);
  EXPECT_NE(error_of(edited(dir, "mixtral_8x7b", {{"model_type", nullptr}})).find("missing field 'model_type'"),
            std::string::npos);
  EXPECT_NE(error_of(edited(dir, "qwen3_235b_a22b", {{"hidden_size", 4096.5}}))
                .find("field 'hidden_size' must be an integer (got 4096.5)"),
            std::string::npos);
  EXPECT_NE(error_of(edited(dir, "qwen3_235b_a22b", {{"num_experts", "128"}}))
                .find("field 'num_experts' must be an integer (got \"128\")"),
            std::string::npos);
  EXPECT_NE(error_of(edited(dir, "qwen3_235b_a22b", {{"mlp_only_layers", json::array({94})}})).find("mlp_only_layers"),
            std::string::npos);
  EXPECT_NE(error_of(edited(dir, "mixtral_8x7b", {{"sliding_window", 4096}})).find("sliding_window 4096"),
            std::string::npos);
  EXPECT_NE(error_of(edited(dir, "mixtral_8x7b", {{"hidden_act", "gelu"}})).find("hidden_act 'gelu'"),
            std::string::npos);
  EXPECT_NE(error_of(edited(dir, "deepseek_v3", {{"norm_topk_prob", false}})).find("norm_topk_prob false"),
            std::string::npos);
  EXPECT_NE(error_of(edited(dir, "qwen3_30b_a3b", {{"attention_bias", true}})).find("attention_bias true"),
            std::string::npos);
  EXPECT_NE(error_of(write_file(dir, "broken.json", "{\"model_type\": \"mixtral\",")).find("not valid JSON"),
            std::string::npos);
  EXPECT_NE(error_of(write_file(dir, "list.json", "[1, 2]")).find("not a JSON object"), std::string::npos);
  EXPECT_NE(error_of(dir.path("absent.json")).find("cannot open"), std::string::npos);
}

// Values of the right type that no model has: each error names the file and the field, not the train flag the field
// becomes.
TEST(PlanHfFlags, OutOfRangeValuesNameTheField) {
  const test::TempDir dir("plan_hf_values");
  const auto expect_error = [&](const std::string& name, const json& changes, const std::string& expected) {
    const std::string message = error_of(edited(dir, name, changes));
    EXPECT_NE(message.find(expected), std::string::npos) << message;
    EXPECT_EQ(message.find("--"), std::string::npos) << message;
  };
  expect_error("mixtral_8x7b", {{"num_hidden_layers", -3}},
               "field 'num_hidden_layers' must be a positive integer (got -3)");
  expect_error("mixtral_8x7b", {{"num_hidden_layers", 100000}},
               "field 'num_hidden_layers' is 100000, above the limit of 65536");
  expect_error("mixtral_8x7b", {{"hidden_size", 0}}, "field 'hidden_size' must be a positive integer (got 0)");
  expect_error("mixtral_8x7b", {{"hidden_size", int64_t{1} << 40}},
               "field 'hidden_size' is 1099511627776, above the limit of 16777216");
  expect_error("mixtral_8x7b", {{"hidden_size", 4100}},
               "field 'hidden_size' (4100) is not a multiple of num_attention_heads (32) and no head_dim is given");
  expect_error("mixtral_8x7b", {{"intermediate_size", -14336}},
               "field 'intermediate_size' must be a positive integer (got -14336)");
  expect_error("mixtral_8x7b", {{"num_attention_heads", 0}},
               "field 'num_attention_heads' must be a positive integer (got 0)");
  expect_error("mixtral_8x7b", {{"num_key_value_heads", -8}},
               "field 'num_key_value_heads' must be a positive integer (got -8)");
  expect_error("mixtral_8x7b", {{"num_key_value_heads", 5}},
               "field 'num_key_value_heads' (5) must divide num_attention_heads (32)");
  expect_error("mixtral_8x7b", {{"max_position_embeddings", -1}},
               "field 'max_position_embeddings' must be a positive integer (got -1)");
  expect_error("mixtral_8x7b", {{"vocab_size", 0}}, "field 'vocab_size' must be a positive integer (got 0)");
  expect_error("mixtral_8x7b", {{"vocab_size", int64_t{1} << 33}},
               "field 'vocab_size' is 8589934592, above the limit of 2147483647");
  expect_error("mixtral_8x7b", {{"num_local_experts", 0}},
               "field 'num_local_experts' must be a positive integer (got 0)");
  expect_error("mixtral_8x7b", {{"num_experts_per_tok", 9}},
               "field 'num_experts_per_tok' is 9, above the routed experts (8)");
  expect_error("mixtral_8x7b", {{"rms_norm_eps", -1e-5}}, "field 'rms_norm_eps' must be a number in (0, 1] (got");
  expect_error("qwen3_30b_a3b", {{"head_dim", 0}}, "field 'head_dim' must be a positive integer (got 0)");
  expect_error("qwen3_30b_a3b", {{"moe_intermediate_size", -768}},
               "field 'moe_intermediate_size' must be a positive integer (got -768)");
  expect_error("qwen3_30b_a3b", {{"decoder_sparse_step", 0}},
               "field 'decoder_sparse_step' must be a positive integer (got 0)");
  expect_error("deepseek_v3", {{"kv_lora_rank", 0}}, "field 'kv_lora_rank' must be a positive integer (got 0)");
  expect_error("deepseek_v3", {{"qk_rope_head_dim", -64}},
               "field 'qk_rope_head_dim' must be a non-negative integer (got -64)");
  expect_error("deepseek_v3", {{"n_group", 7}}, "field 'n_group' (7) must divide n_routed_experts (256)");
  expect_error("deepseek_v3", {{"topk_group", 9}}, "field 'topk_group' is 9, above n_group (8)");
  expect_error("deepseek_v3", {{"n_shared_experts", -1}},
               "field 'n_shared_experts' must be a non-negative integer (got -1)");
  expect_error("deepseek_v3", {{"num_nextn_predict_layers", -1}},
               "field 'num_nextn_predict_layers' must be a non-negative integer (got -1)");
  expect_error("deepseek_v3", {{"routed_scaling_factor", 0}},
               "field 'routed_scaling_factor' must be a number in (0, 100] (got 0)");
  expect_error("qwen3_30b_a3b", {{"partial_rotary_factor", 1.5}},
               "field 'partial_rotary_factor' must be a number in (0, 1] (got 1.5)");
}

// A model folder reads its config.json, as HuggingFace's from_pretrained does; a folder without one is named as such.
TEST(PlanHfFlags, ModelFolder) {
  const test::TempDir dir("plan_hf_folder");
  fs::create_directories(dir.path("mixtral"));
  fs::copy_file(fixture("mixtral_8x7b"), dir.path("mixtral/config.json"));
  EXPECT_EQ(megatron_flags_from_hf_config(dir.path("mixtral")), kMixtral8x7B);

  fs::create_directories(dir.path("empty"));
  EXPECT_NE(error_of(dir.path("empty")).find("a folder without config.json"), std::string::npos);

  fs::create_directories(dir.path("bad"));
  write_file(dir, "bad/config.json", "{\"model_type\": \"mixtral\", \"num_hidden_layers\": -3}");
  const std::string message = error_of(dir.path("bad/config.json"));
  EXPECT_NE(message.find("field 'num_hidden_layers' must be a positive integer (got -3)"), std::string::npos);
  try {
    megatron_flags_from_hf_config(dir.path("bad"));
    ADD_FAILURE() << "no error for the folder";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), message);  // the folder's error names its config.json
  }

  // A folder whose config.json is a folder itself.
  fs::create_directories(dir.path("odd/config.json"));
  try {
    megatron_flags_from_hf_config(dir.path("odd"));
    ADD_FAILURE() << "no error for odd/config.json";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), dir.path("odd/config.json") + ": a folder, not a config.json file");
  }
}

TEST(PlanHfFlags, InvalidJsonWithoutLibraryText) {
  const test::TempDir dir("plan_hf_json");
  const std::string message = error_of(write_file(dir, "broken.json", "{\"model_type\": \"mixtral\","));
  EXPECT_NE(message.find("not valid JSON (parse error at line 1, column"), std::string::npos) << message;
  EXPECT_EQ(message.find("json.exception"), std::string::npos) << message;
}

}  // namespace
}  // namespace moecore::plan
