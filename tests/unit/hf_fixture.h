// What the HuggingFace export / import tests share: a tiny llama-style model HF can hold (each test varies the few
// fields it is about), its Mixtral-style MoE variant, random parameter values, and a per-test folder.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "moecore/ckpt/hf_checkpoint.h"
#include "moecore/model/gpt_model.h"
#include "unit/test_temp_dir.h"

namespace moecore::test {

// Llama-style: 2 layers, hidden 32, GQA (4 heads, 2 groups of 8), SwiGLU of 48, RMSNorm (eps 1e-6), RoPE (base 1e6)
// over 64 positions, sequence 8, vocabulary 80, no biases, no dropout, tied output.
inline ModelConfig hf_llama_config() {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.ffn_hidden_size = 48;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.kv_channels = 8;
  c.seq_length = 8;
  c.max_position_embeddings = 64;
  c.vocab_size = 80;
  c.normalization = Normalization::kRMSNorm;
  c.norm_epsilon = 1e-6;
  c.activation = Activation::kSwiGLU;
  c.add_bias_linear = false;
  c.position_embedding_type = PositionEmbedding::kRope;
  c.rotary_base = 1e6;
  c.attention_dropout = 0.0;
  c.hidden_dropout = 0.0;
  return c;
}

// hf_llama_config with NUM_LAYERS layers, an untied output and every layer MoE: 4 experts of width 24, top-2.
inline ModelConfig hf_moe_config(const int64_t num_layers) {
  ModelConfig c = hf_llama_config();
  c.num_layers = num_layers;
  c.untie_embeddings_and_output_weights = true;
  c.moe.num_experts = 4;
  c.moe.ffn_hidden_size = 24;
  c.moe.moe_layer_pattern.assign(static_cast<size_t>(num_layers), true);
  c.moe.topk = 2;
  return c;
}

// DeepSeek-V3-like without MLA (HF's moecore_moe): hf_moe_config(3) with a dense first layer, 8 experts, sigmoid
// scores, top-4 of the top-2 of 4 groups, an expert bias, scaling factor 2.5 and a gated shared expert of width 20.
inline ModelConfig hf_deepseek_like_config() {
  ModelConfig c = hf_moe_config(3);
  c.moe.moe_layer_pattern = {false, true, true};
  c.moe.num_experts = 8;
  c.moe.topk = 4;
  c.moe.score_function = RouterScoreFunction::kSigmoid;
  c.moe.num_groups = 4;
  c.moe.group_topk = 2;
  c.moe.enable_expert_bias = true;
  c.moe.topk_scaling_factor = 2.5;
  c.moe.shared_expert_intermediate_size = 20;
  c.moe.shared_expert_gate = true;
  return c;
}

enum class RandomBuffers : bool { kNo, kYes };

// Distinct random values in every parameter (then, with RandomBuffers::kYes, every buffer), so a misplaced row cannot
// go unnoticed.
inline void randomize(GPTModel& model, const uint64_t seed, const RandomBuffers buffers = RandomBuffers::kNo) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (Param& p : model.params()) {
    for (float& v : p.value.span<float>()) v = dist(gen);
  }
  if (buffers == RandomBuffers::kNo) return;
  for (Buffer& b : model.named_buffers()) {
    for (float& v : b.value.span<float>()) v = dist(gen);
  }
}

// TEXT with its first FROM replaced by TO.
inline std::string replaced(std::string text, const std::string& from, const std::string& to) {
  text.replace(text.find(from), from.size(), to);
  return text;
}

// A test with a fresh folder of its own: path(NAME) is a file or folder in it.
class HfFolderTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return dir_.path(name); }

  // The error read_hf_config gives for the folder bad/ whose config.json holds TEXT (a test failure if none).
  std::string config_error(const std::string& text) const {
    std::filesystem::create_directories(path("bad"));
    std::ofstream(path("bad/config.json")) << text;
    try {
      read_hf_config(path("bad"));
      ADD_FAILURE() << "no error";
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  }

  // config_error(TEXT) names the file and holds PHRASE.
  void expect_config_error(const std::string& text, const std::string& phrase) const {
    SCOPED_TRACE(phrase);
    const std::string message = config_error(text);
    EXPECT_NE(message.find("config.json"), std::string::npos) << message;
    EXPECT_NE(message.find(phrase), std::string::npos) << message;
  }

 private:
  TempDir dir_{"hf"};
};

}  // namespace moecore::test
