// HF export/import of MoE models: Mixtral ("mixtral"), Qwen3-MoE ("qwen3_moe") and moecore's own "moecore_moe" (the
// DeepSeek-V3-like config without MLA). Checks, each against index formulas and field names written here from HF's
// MixtralConfig / Qwen3MoeConfig and their modeling files (not from the exporter's tables):
// - every expert's gate / up / down rows and the router land in the HF tensor HF's class reads them from;
// - config.json carries HF's field names with the model's values (num_local_experts vs num_experts, norm_topk_prob,
//   mlp_only_layers, moe_intermediate_size, ...);
// - export -> load_hf gives back the same ModelConfig (MoE part included), every parameter bit for bit and the same
//   logits, for each type (moecore_moe also with linear biases, q/k norms and a capacity factor);
// - published-style HF configs without moecore's block are read as HF's classes interpret them;
// - models or configs HF cannot represent are refused with one line naming what.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "moecore/ckpt/hf_checkpoint.h"
#include "moecore/ckpt/safetensors.h"
#include "unit/hf_fixture.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using test::randomize;

// The shared MoE model with aux_loss (0.01) and a z-loss (1e-3).
ModelConfig base_config(const int64_t num_layers) {
  ModelConfig c = test::hf_moe_config(num_layers);
  c.moe.load_balancing_types = {LoadBalancingType::kAuxLoss};
  c.moe.aux_loss_coeffs = {0.01};
  c.moe.z_loss_coeff = 1e-3;
  return c;
}

ModelConfig mixtral_config() { return base_config(2); }

ModelConfig qwen3_moe_config() {
  ModelConfig c = base_config(3);
  c.qk_layernorm = true;
  c.moe.moe_layer_pattern = {false, true, true};
  c.moe.num_experts = 6;
  c.moe.ffn_hidden_size = 16;
  c.moe.router_dtype = RouterDType::kFP64;  // training-only setting carried by moecore's block
  return c;
}

// DeepSeek-V3-like without MLA: sigmoid scores, group-limited routing, expert bias, scaling factor, seq_aux_loss,
// a gated shared expert, the first layer dense.
ModelConfig deepseek_like_config() {
  ModelConfig c = test::hf_deepseek_like_config();
  c.moe.bias_update_rate = 2e-3;
  c.moe.load_balancing_types = {LoadBalancingType::kSeqAuxLoss};
  c.moe.aux_loss_coeffs = {1e-4};
  c.moe.z_loss_coeff = 0.0;
  c.moe.grouped_gemm = true;
  return c;
}

void expect_same_moe(const MoEConfig& a, const MoEConfig& b) {
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.ffn_hidden_size, b.ffn_hidden_size);
  EXPECT_EQ(a.moe_layer_pattern, b.moe_layer_pattern);
  EXPECT_EQ(a.topk, b.topk);
  EXPECT_EQ(a.score_function, b.score_function);
  EXPECT_EQ(a.pre_softmax, b.pre_softmax);
  EXPECT_EQ(a.topk_scaling_factor, b.topk_scaling_factor);
  EXPECT_EQ(a.num_groups, b.num_groups);
  EXPECT_EQ(a.group_topk, b.group_topk);
  EXPECT_EQ(a.input_jitter_eps, b.input_jitter_eps);
  EXPECT_EQ(a.router_dtype, b.router_dtype);
  EXPECT_EQ(a.enable_expert_bias, b.enable_expert_bias);
  EXPECT_EQ(a.bias_update_rate, b.bias_update_rate);
  EXPECT_EQ(a.force_load_balancing, b.force_load_balancing);
  EXPECT_EQ(a.load_balancing_types, b.load_balancing_types);
  EXPECT_EQ(a.aux_loss_coeffs, b.aux_loss_coeffs);
  EXPECT_EQ(a.z_loss_coeff, b.z_loss_coeff);
  EXPECT_EQ(a.capacity_factor, b.capacity_factor);
  EXPECT_EQ(a.drop_policy, b.drop_policy);
  EXPECT_EQ(a.pad_expert_input_to_capacity, b.pad_expert_input_to_capacity);
  EXPECT_EQ(a.apply_probs_on_input, b.apply_probs_on_input);
  EXPECT_EQ(a.grouped_gemm, b.grouped_gemm);
  EXPECT_EQ(a.shared_expert_intermediate_size, b.shared_expert_intermediate_size);
  EXPECT_EQ(a.shared_expert_gate, b.shared_expert_gate);
  EXPECT_EQ(a.per_layer_logging, b.per_layer_logging);
}

void expect_same_config(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.ffn_hidden_size, b.ffn_hidden_size);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_query_groups, b.num_query_groups);
  EXPECT_EQ(a.kv_channels, b.kv_channels);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.norm_epsilon, b.norm_epsilon);
  EXPECT_EQ(a.add_bias_linear, b.add_bias_linear);
  EXPECT_EQ(a.qk_layernorm, b.qk_layernorm);
  EXPECT_EQ(a.rotary_base, b.rotary_base);
  EXPECT_EQ(a.untie_embeddings_and_output_weights, b.untie_embeddings_and_output_weights);
  expect_same_moe(a.moe, b.moe);
}

// Expected row r of HF tensor `hf` equals row `megatron_row` of Megatron parameter `param`, for every row.
void expect_rows(const SafetensorsFile& file, const std::string& hf, const GPTModel& model, const std::string& param,
                 const int64_t rows, const int64_t first_megatron_row) {
  ASSERT_TRUE(file.contains(hf)) << hf;
  const Tensor& value = file.at(hf);
  const Tensor& source = model.param(param).value;
  const int64_t cols = source.numel() / source.dim(0);
  std::vector<int64_t> shape = source.shape();
  shape[0] = rows;
  ASSERT_EQ(value.shape(), shape) << hf;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t col = 0; col < cols; ++col) {
      ASSERT_EQ(value.data<float>()[r * cols + col], source.data<float>()[(first_megatron_row + r) * cols + col])
          << hf << " row " << r << " col " << col;
    }
  }
}

class HfMoeTest : public test::HfFolderTest {
 protected:
  void write_text(const std::string& name, const std::string& text) const { std::ofstream(path(name)) << text; }
  json read_config(const std::string& export_dir) const {
    std::ifstream in(export_dir + "/config.json");
    return json::parse(in);
  }

  // Exports, checks that load_hf returns the same config and bit-identical parameters and logits.
  json round_trip(const ModelConfig& c, const std::string& expected_type, SafetensorsFile& file,
                  std::unique_ptr<GPTModel>& model) {
    model = std::make_unique<GPTModel>(c, 1);
    randomize(*model, 11);
    for (int64_t l = 0; l < c.num_layers; ++l) {  // a trained-looking expert bias (it changes the selection)
      Buffer* bias = model->expert_bias(l);
      for (int64_t e = 0; bias != nullptr && e < bias->value.numel(); ++e) {
        bias->value.data<float>()[e] = 0.5f * static_cast<float>(e % 3) - 0.4f;
      }
    }
    const std::string out = path(expected_type);
    export_hf(*model, HfExportInfo{}, out);
    file = read_safetensors(out + "/model.safetensors");
    const json config = read_config(out);
    EXPECT_EQ(config["model_type"], expected_type);

    const std::unique_ptr<GPTModel> loaded = load_hf(out, HfImportOptions{.seq_length = c.seq_length});
    expect_same_config(loaded->config(), c);
    EXPECT_EQ(loaded->params().size(), model->params().size());
    for (const Param& p : model->params()) {
      const Tensor& back = loaded->param(p.name).value;
      EXPECT_EQ(back.shape(), p.value.shape()) << p.name;
      if (back.shape() == p.value.shape()) {
        EXPECT_EQ(std::memcmp(back.data<float>(), p.value.data<float>(), p.value.nbytes()), 0) << p.name;
      }
    }
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const Buffer* bias = model->expert_bias(l);
      if (bias != nullptr) {
        const auto want = bias->value.span<float>();
        const auto got = loaded->expert_bias(l)->value.span<float>();
        EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin(), want.end())) << "expert bias of layer " << l;
      }
    }
    // Same config and weights must give the same eval forward, bit for bit.
    std::vector<int32_t> tokens_BS(2 * c.seq_length);
    for (size_t i = 0; i < tokens_BS.size(); ++i) tokens_BS[i] = static_cast<int32_t>((i * 37 + 5) % c.vocab_size);
    const Tensor before = model->last_logits(tokens_BS.data(), 2, c.seq_length);
    const Tensor after = loaded->last_logits(tokens_BS.data(), 2, c.seq_length);
    EXPECT_EQ(std::memcmp(before.data<float>(), after.data<float>(), before.nbytes()), 0);
    return config;
  }
};

TEST_F(HfMoeTest, MixtralNamesConfigAndExactRoundTrip) {
  const ModelConfig c = mixtral_config();
  EXPECT_EQ(hf_model_type(c), "mixtral");
  SafetensorsFile file;
  std::unique_ptr<GPTModel> model;
  const json config = round_trip(c, "mixtral", file, model);
  const int64_t E = c.moe.num_experts, Fe = c.moe.ffn_hidden_size, H = c.hidden_size;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string P = "model.layers." + std::to_string(i) + ".block_sparse_moe.";
    const std::string M = "decoder.layers." + std::to_string(i) + ".mlp.";
    expect_rows(file, P + "gate.weight", *model, M + "router.weight", E, 0);
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = P + "experts." + std::to_string(e) + ".";
      const std::string local = M + "experts.local_experts." + std::to_string(e) + ".";
      expect_rows(file, x + "w1.weight", *model, local + "linear_fc1.weight", Fe, 0);   // gate half
      expect_rows(file, x + "w3.weight", *model, local + "linear_fc1.weight", Fe, Fe);  // up half
      expect_rows(file, x + "w2.weight", *model, local + "linear_fc2.weight", H, 0);
    }
    EXPECT_FALSE(file.contains("model.layers." + std::to_string(i) + ".mlp.gate_proj.weight"));
  }
  // embed + norm + head + per layer (2 norms, q/k/v/o, gate, 3 per expert)
  EXPECT_EQ(static_cast<int64_t>(file.tensors.size()), 3 + c.num_layers * (2 + 4 + 1 + 3 * E));

  // MixtralConfig's field names.
  EXPECT_EQ(config["architectures"], json::array({"MixtralForCausalLM"}));
  EXPECT_EQ(config["num_local_experts"], E);
  EXPECT_EQ(config["num_experts_per_tok"], c.moe.topk);
  EXPECT_EQ(config["intermediate_size"], Fe);  // MixtralConfig's intermediate_size is the expert width
  EXPECT_EQ(config["hidden_size"], H);
  EXPECT_EQ(config["num_hidden_layers"], c.num_layers);
  EXPECT_EQ(config["num_key_value_heads"], c.num_query_groups);
  EXPECT_EQ(config["head_dim"], c.kv_channels);
  EXPECT_EQ(config["rope_theta"], c.rotary_base);
  EXPECT_EQ(config["router_aux_loss_coef"], 0.01);
  EXPECT_EQ(config["hidden_act"], "silu");
  EXPECT_EQ(config["tie_word_embeddings"], false);
  EXPECT_FALSE(config.contains("attention_bias"));
  EXPECT_FALSE(config.contains("num_experts"));
}

TEST_F(HfMoeTest, Qwen3MoeNamesConfigAndExactRoundTrip) {
  for (const bool pre_softmax : {false, true}) {
    SCOPED_TRACE(pre_softmax ? "pre-softmax" : "post-softmax");
    ModelConfig c = qwen3_moe_config();
    c.moe.pre_softmax = pre_softmax;
    EXPECT_EQ(hf_model_type(c), "qwen3_moe");
    SafetensorsFile file;
    std::unique_ptr<GPTModel> model;
    const json config = round_trip(c, "qwen3_moe", file, model);
    const int64_t E = c.moe.num_experts, Fe = c.moe.ffn_hidden_size, F = c.ffn_hidden_size, H = c.hidden_size;
    // Layer 0 is dense: Qwen3MoeMLP with intermediate_size.
    expect_rows(file, "model.layers.0.mlp.gate_proj.weight", *model, "decoder.layers.0.mlp.linear_fc1.weight", F, 0);
    expect_rows(file, "model.layers.0.mlp.up_proj.weight", *model, "decoder.layers.0.mlp.linear_fc1.weight", F, F);
    expect_rows(file, "model.layers.0.mlp.down_proj.weight", *model, "decoder.layers.0.mlp.linear_fc2.weight", H, 0);
    EXPECT_FALSE(file.contains("model.layers.0.mlp.gate.weight"));
    for (int64_t i = 1; i < c.num_layers; ++i) {
      const std::string P = "model.layers." + std::to_string(i) + ".";
      const std::string M = "decoder.layers." + std::to_string(i) + ".";
      expect_rows(file, P + "mlp.gate.weight", *model, M + "mlp.router.weight", E, 0);
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = P + "mlp.experts." + std::to_string(e) + ".";
        const std::string local = M + "mlp.experts.local_experts." + std::to_string(e) + ".";
        expect_rows(file, x + "gate_proj.weight", *model, local + "linear_fc1.weight", Fe, 0);
        expect_rows(file, x + "up_proj.weight", *model, local + "linear_fc1.weight", Fe, Fe);
        expect_rows(file, x + "down_proj.weight", *model, local + "linear_fc2.weight", H, 0);
      }
      expect_rows(file, P + "self_attn.q_norm.weight", *model, M + "self_attention.q_layernorm.weight", c.kv_channels,
                  0);
    }
    EXPECT_EQ(static_cast<int64_t>(file.tensors.size()),
              3 + c.num_layers * (2 + 4 + 2) + 3 + (c.num_layers - 1) * (1 + 3 * E));

    // Qwen3MoeConfig's field names.
    EXPECT_EQ(config["architectures"], json::array({"Qwen3MoeForCausalLM"}));
    EXPECT_EQ(config["num_experts"], E);
    EXPECT_EQ(config["num_experts_per_tok"], c.moe.topk);
    EXPECT_EQ(config["moe_intermediate_size"], Fe);
    EXPECT_EQ(config["intermediate_size"], F);
    EXPECT_EQ(config["mlp_only_layers"], json::array({0}));
    EXPECT_EQ(config["decoder_sparse_step"], 1);
    EXPECT_EQ(config["norm_topk_prob"], !pre_softmax);  // renormalising the top-k == Megatron's post-softmax
    EXPECT_EQ(config["use_sliding_window"], false);
    EXPECT_EQ(config["attention_bias"], false);
    EXPECT_EQ(config["router_aux_loss_coef"], 0.01);
  }
}

TEST_F(HfMoeTest, DeepSeekLikeExportsAsMoecoreMoeAndRoundTrips) {
  const ModelConfig c = deepseek_like_config();
  EXPECT_EQ(hf_model_type(c), "moecore_moe");
  SafetensorsFile file;
  std::unique_ptr<GPTModel> model;
  const json config = round_trip(c, "moecore_moe", file, model);
  const int64_t S = c.moe.shared_expert_intermediate_size, Fe = c.moe.ffn_hidden_size, H = c.hidden_size;
  for (int64_t i = 1; i < c.num_layers; ++i) {
    const std::string P = "model.layers." + std::to_string(i) + ".mlp.";
    const std::string M = "decoder.layers." + std::to_string(i) + ".mlp.";
    expect_rows(file, P + "gate.weight", *model, M + "router.weight", c.moe.num_experts, 0);
    expect_rows(file, P + "experts.7.up_proj.weight", *model, M + "experts.local_experts.7.linear_fc1.weight", Fe, Fe);
    expect_rows(file, P + "shared_experts.gate_proj.weight", *model, M + "shared_experts.linear_fc1.weight", S, 0);
    expect_rows(file, P + "shared_experts.up_proj.weight", *model, M + "shared_experts.linear_fc1.weight", S, S);
    expect_rows(file, P + "shared_experts.down_proj.weight", *model, M + "shared_experts.linear_fc2.weight", H, 0);
    expect_rows(file, P + "shared_expert_gate.weight", *model, M + "shared_experts.gate_weight", 1, 0);
  }
  EXPECT_EQ(config["architectures"], json::array({"MoecoreMoeForCausalLM"}));
  EXPECT_EQ(config["mlp_only_layers"], json::array({0}));
  const json& block = config["moecore_moe_config"];
  EXPECT_EQ(block["moe_router_score_function"], "sigmoid");
  EXPECT_EQ(block["moe_router_num_groups"], 4);
  EXPECT_EQ(block["moe_router_group_topk"], 2);
  EXPECT_EQ(block["moe_router_topk_scaling_factor"], 2.5);
  EXPECT_EQ(block["moe_router_enable_expert_bias"], true);
  EXPECT_EQ(block["moe_router_load_balancing_type"], json::array({"seq_aux_loss"}));
  EXPECT_EQ(block["moe_layer_freq"], json::array({0, 1, 1}));
  EXPECT_EQ(block["moe_shared_expert_intermediate_size"], S);
  EXPECT_EQ(block["moe_expert_capacity_factor"], nullptr);
}

TEST_F(HfMoeTest, MoecoreMoeCarriesLinearBiasesAndCapacity) {
  ModelConfig c = deepseek_like_config();
  c.add_bias_linear = true;
  c.moe.shared_expert_intermediate_size = 0;  // shared experts refuse --add-bias-linear, as Megatron's
  c.moe.shared_expert_gate = false;
  c.qk_layernorm = true;
  c.moe.capacity_factor = 1.5;
  c.moe.drop_policy = TokenDropPolicy::kPosition;
  EXPECT_EQ(hf_model_type(c), "moecore_moe");
  SafetensorsFile file;
  std::unique_ptr<GPTModel> model;
  const json config = round_trip(c, "moecore_moe", file, model);
  const std::string P = "model.layers.2.mlp.", M = "decoder.layers.2.mlp.";
  expect_rows(file, P + "gate.bias", *model, M + "router.bias", c.moe.num_experts, 0);
  expect_rows(file, P + "experts.3.up_proj.bias", *model, M + "experts.local_experts.3.linear_fc1.bias",
              c.moe.ffn_hidden_size, c.moe.ffn_hidden_size);
  expect_rows(file, P + "experts.3.down_proj.bias", *model, M + "experts.local_experts.3.linear_fc2.bias",
              c.hidden_size, 0);
  EXPECT_EQ(config["attention_bias"], true);
  EXPECT_EQ(config["mlp_bias"], true);
  EXPECT_EQ(config["qk_layernorm"], true);
  EXPECT_EQ(config["moecore_moe_config"]["moe_expert_capacity_factor"], 1.5);
  EXPECT_EQ(config["moecore_moe_config"]["moe_token_drop_policy"], "position");
}

TEST_F(HfMoeTest, ChoosesAndRefusesModelTypes) {
  const auto refused = [](const ModelConfig& c, const std::string& requested, const std::string& phrase) {
    try {
      hf_model_type(c, requested);
      ADD_FAILURE() << "no error for " << phrase;
    } catch (const ConfigError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(phrase), std::string::npos) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
  };
  ModelConfig c = mixtral_config();
  c.qk_layernorm = true;
  EXPECT_EQ(hf_model_type(c), "qwen3_moe");
  refused(c, "mixtral", "--qk-layernorm");
  c = mixtral_config();
  refused(c, "qwen3_moe", "--qk-layernorm");
  c.moe.pre_softmax = true;
  EXPECT_EQ(hf_model_type(c), "moecore_moe");  // mixtral always renormalises; qwen3_moe needs q/k norms
  refused(c, "mixtral", "--moe-router-pre-softmax");
  c = mixtral_config();
  c.moe.moe_layer_pattern = {true, false};
  refused(c, "mixtral", "dense layer 1");
  c = mixtral_config();
  c.moe.capacity_factor = 1.0;
  EXPECT_EQ(hf_model_type(c), "moecore_moe");
  refused(c, "mixtral", "--moe-expert-capacity-factor");
  c = mixtral_config();
  c.moe.shared_expert_intermediate_size = 16;
  refused(c, "mixtral", "shared experts");
  c = mixtral_config();
  c.add_bias_linear = true;
  refused(c, "mixtral", "--add-bias-linear");
  c = qwen3_moe_config();
  c.moe.score_function = RouterScoreFunction::kSigmoid;
  EXPECT_EQ(hf_model_type(c), "moecore_moe");
  refused(c, "qwen3_moe", "sigmoid");
  c = qwen3_moe_config();
  c.moe.enable_expert_bias = true;
  refused(c, "qwen3_moe", "--moe-router-enable-expert-bias");
  refused(mixtral_config(), "llama", "MoE layers");
  refused(base_config(2), "qwen3", "MoE layers");
  ModelConfig dense = mixtral_config();
  dense.moe = MoEConfig();
  refused(dense, "mixtral", "needs a MoE model");
  EXPECT_EQ(hf_model_type(dense), "llama");
  c = mixtral_config();
  c.normalization = Normalization::kLayerNorm;
  refused(c, "", "LayerNorm");  // no HF or moecore_moe layout for LayerNorm models
  refused(mixtral_config(), "deepseek_v3", "cannot represent standard attention");
  refused(mixtral_config(), "deepseek_v2", "unknown model_type");

  // A refused export writes nothing.
  c = mixtral_config();
  c.moe.capacity_factor = 1.0;
  GPTModel model(c, 2);
  HfExportInfo info;
  info.model_type = "mixtral";
  EXPECT_THROW(export_hf(model, info, path("refused")), ConfigError);
  EXPECT_FALSE(fs::exists(path("refused")));
  EXPECT_FALSE(fs::exists(path("refused.tmp")));
}

// Shaped after the published Mixtral-8x7B / Qwen3-30B-A3B config.json files (fields of HF's config classes), small.
constexpr const char* kMixtralConfig = R"({
  "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 112,
  "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 256,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "vocab_size": 128, "tie_word_embeddings": false,
  "hidden_act": "silu", "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
  "output_router_logits": false, "sliding_window": null, "attention_dropout": 0.0, "bos_token_id": 1,
  "eos_token_id": 2, "torch_dtype": "bfloat16"})";

constexpr const char* kQwen3MoeConfig = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96,
  "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
  "head_dim": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "vocab_size": 128, "tie_word_embeddings": false, "attention_bias": false, "use_sliding_window": false,
  "hidden_act": "silu", "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": true,
  "decoder_sparse_step": 2, "mlp_only_layers": [3], "router_aux_loss_coef": 0.001})";

TEST_F(HfMoeTest, ReadsPublishedStyleConfigsAsHfInterpretsThem) {
  fs::create_directories(path("mixtral"));
  write_text("mixtral/config.json", kMixtralConfig);
  const ModelConfig m = read_hf_config(path("mixtral"));
  EXPECT_EQ(m.moe.num_experts, 8);
  EXPECT_EQ(m.moe.topk, 2);
  EXPECT_EQ(m.moe.ffn_hidden_size, 112);
  EXPECT_EQ(m.ffn_hidden_size, 112);
  EXPECT_EQ(m.moe.moe_layer_pattern, std::vector<bool>({true, true}));
  EXPECT_EQ(m.moe.score_function, RouterScoreFunction::kSoftmax);
  EXPECT_FALSE(m.moe.pre_softmax);
  EXPECT_FALSE(m.qk_layernorm);
  EXPECT_EQ(m.moe.load_balancing_types, std::vector<LoadBalancingType>({LoadBalancingType::kAuxLoss}));
  EXPECT_EQ(m.moe.aux_loss_coeffs, std::vector<double>({0.02}));
  EXPECT_EQ(m.kv_channels, 8);

  fs::create_directories(path("qwen3_moe"));
  write_text("qwen3_moe/config.json", kQwen3MoeConfig);
  const ModelConfig q = read_hf_config(path("qwen3_moe"));
  EXPECT_TRUE(q.qk_layernorm);
  EXPECT_EQ(q.moe.num_experts, 16);
  EXPECT_EQ(q.moe.topk, 4);
  EXPECT_EQ(q.moe.ffn_hidden_size, 32);
  EXPECT_EQ(q.ffn_hidden_size, 96);
  EXPECT_FALSE(q.moe.pre_softmax);
  // Sparse iff not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0: layers 1 only (3 is listed).
  EXPECT_EQ(q.moe.moe_layer_pattern, std::vector<bool>({false, true, false, false}));
  EXPECT_EQ(q.kv_channels, 32);

  // norm_topk_prob false (HF's default) is Megatron's pre-softmax routing.
  std::string text = kQwen3MoeConfig;
  text.replace(text.find("\"norm_topk_prob\": true"), 22, "\"norm_topk_prob\": false");
  write_text("qwen3_moe/config.json", text);
  EXPECT_TRUE(read_hf_config(path("qwen3_moe")).moe.pre_softmax);
}

TEST_F(HfMoeTest, MoeConfigProblemsNameTheFileAndField) {
  json qwen = json::parse(kQwen3MoeConfig);
  qwen["attention_bias"] = true;
  expect_config_error(qwen.dump(), "attention_bias");
  qwen = json::parse(kQwen3MoeConfig);
  qwen.erase("num_experts_per_tok");
  expect_config_error(qwen.dump(), "num_experts_per_tok");
  qwen = json::parse(kQwen3MoeConfig);
  qwen["num_experts_per_tok"] = 17;  // more than num_experts
  expect_config_error(qwen.dump(), "topk");

  // moecore's block: required for moecore_moe; malformed entries are named; for mixtral it cannot smuggle in a
  // forward HF would not compute.
  GPTModel model(deepseek_like_config(), 3);
  export_hf(model, HfExportInfo{}, path("ds"));
  json ds = read_config(path("ds"));
  json no_block = ds;
  no_block.erase("moecore_moe_config");
  expect_config_error(no_block.dump(), "moecore_moe_config");
  json bad_score = ds;
  bad_score["moecore_moe_config"]["moe_router_score_function"] = "tanh";
  expect_config_error(bad_score.dump(), "moe_router_score_function");
  json short_pattern = ds;
  short_pattern["moecore_moe_config"]["moe_layer_freq"] = json::array({1, 1});
  expect_config_error(short_pattern.dump(), "moe_layer_freq");
  json disagree = ds;
  disagree["num_experts"] = 3;
  expect_config_error(disagree.dump(), "num_experts");

  GPTModel mixtral(mixtral_config(), 4);
  export_hf(mixtral, HfExportInfo{}, path("mx"));
  json mx = read_config(path("mx"));
  mx["moecore_moe_config"]["moe_expert_capacity_factor"] = 1.5;
  expect_config_error(mx.dump(), "--moe-expert-capacity-factor");
}

}  // namespace
}  // namespace moecore
