// HF export/import: the exported tensors hold the right rows of the Megatron parameters (checked element by element
// with index formulas written here from the two layouts), an export loads back bit for bit, config.json parsing of
// hand-written llama/qwen3 configs, and clear errors for what HF cannot represent. (The forward-level check, the
// export's logits under an HF-style PyTorch forward, is tests/oracle/test_hf_export.py.)
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "moecore/ckpt/hf_checkpoint.h"
#include "moecore/ckpt/safetensors.h"
#include "unit/hf_fixture.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

using test::randomize;

// The shared llama-style model with a sequence of 16, a vocabulary of 96 and Llama 3's RoPE base.
ModelConfig llama_config() {
  ModelConfig c = test::hf_llama_config();
  c.seq_length = 16;
  c.vocab_size = 96;
  c.rotary_base = 500000.0;
  return c;
}

class HfCheckpointTest : public test::HfFolderTest {
 protected:
  void write_text(const std::string& file, const std::string& text) const { std::ofstream(file) << text; }
};

TEST_F(HfCheckpointTest, ExportPlacesEveryRowAndLoadsBackExactly) {
  for (const bool qwen3 : {false, true}) {
    for (const bool bias : {false, true}) {
      if (qwen3 && bias) continue;  // qwen3 has no MLP biases
      SCOPED_TRACE(std::string(qwen3 ? "qwen3" : "llama") + (bias ? " bias" : ""));
      ModelConfig c = llama_config();
      c.qk_layernorm = qwen3;
      c.add_bias_linear = bias;
      c.untie_embeddings_and_output_weights = bias;  // cover tied and untied
      GPTModel model(c, 1);
      randomize(model, 7);
      const std::string out = path("export");
      export_hf(model, HfExportInfo{}, out);
      const SafetensorsFile file = read_safetensors(out + "/model.safetensors");

      const int64_t N = c.num_attention_heads, G = c.num_query_groups, d = c.kv_channels, H = c.hidden_size;
      const int64_t F = c.ffn_hidden_size, per_group = N / G;
      for (int64_t layer = 0; layer < c.num_layers; ++layer) {
        const std::string P = "model.layers." + std::to_string(layer) + ".";
        const std::string M = "decoder.layers." + std::to_string(layer) + ".";
        const Tensor& qkv = model.param(M + "self_attention.linear_qkv.weight").value;
        const Tensor& q = file.at(P + "self_attn.q_proj.weight");
        const Tensor& k = file.at(P + "self_attn.k_proj.weight");
        const Tensor& v = file.at(P + "self_attn.v_proj.weight");
        ASSERT_EQ(q.shape(), std::vector<int64_t>({N * d, H}));
        ASSERT_EQ(k.shape(), std::vector<int64_t>({G * d, H}));
        // Query head n = g * per_group + j lives in Megatron rows g*(per_group+2)*d + j*d + r.
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t r = 0; r < d; ++r) {
            const int64_t megatron_row = (n / per_group) * (per_group + 2) * d + (n % per_group) * d + r;
            for (int64_t col = 0; col < H; col += 7) {
              ASSERT_EQ(q.data<float>()[(n * d + r) * H + col], qkv.data<float>()[megatron_row * H + col]);
            }
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t r = 0; r < d; ++r) {
            const int64_t k_row = g * (per_group + 2) * d + per_group * d + r;
            for (int64_t col = 0; col < H; col += 5) {
              ASSERT_EQ(k.data<float>()[(g * d + r) * H + col], qkv.data<float>()[k_row * H + col]);
              ASSERT_EQ(v.data<float>()[(g * d + r) * H + col], qkv.data<float>()[(k_row + d) * H + col]);
            }
          }
        }
        const Tensor& fc1 = model.param(M + "mlp.linear_fc1.weight").value;
        const Tensor& gate = file.at(P + "mlp.gate_proj.weight");
        const Tensor& up = file.at(P + "mlp.up_proj.weight");
        ASSERT_EQ(gate.shape(), std::vector<int64_t>({F, H}));
        EXPECT_EQ(gate.data<float>()[3 * H + 1], fc1.data<float>()[3 * H + 1]);
        EXPECT_EQ(up.data<float>()[3 * H + 1], fc1.data<float>()[(F + 3) * H + 1]);
        if (bias) {
          const Tensor& qkv_bias = model.param(M + "self_attention.linear_qkv.bias").value;
          // k bias of group 1, channel 2
          EXPECT_EQ(file.at(P + "self_attn.k_proj.bias").data<float>()[d + 2],
                    qkv_bias.data<float>()[(per_group + 2) * d + per_group * d + 2]);
          EXPECT_TRUE(file.contains(P + "self_attn.o_proj.bias"));
          EXPECT_TRUE(file.contains(P + "mlp.down_proj.bias"));
        }
        EXPECT_EQ(file.contains(P + "self_attn.q_norm.weight"), qwen3);
      }
      EXPECT_EQ(file.contains("lm_head.weight"), c.untie_embeddings_and_output_weights);

      const std::unique_ptr<GPTModel> loaded = load_hf(out, HfImportOptions{.seq_length = c.seq_length});
      EXPECT_EQ(loaded->config().qk_layernorm, qwen3);
      EXPECT_EQ(loaded->config().add_bias_linear, bias);
      EXPECT_EQ(loaded->config().untie_embeddings_and_output_weights, c.untie_embeddings_and_output_weights);
      EXPECT_EQ(loaded->config().rotary_base, c.rotary_base);
      ASSERT_EQ(loaded->params().size(), model.params().size());
      for (const Param& p : model.params()) {
        const Tensor& back = loaded->param(p.name).value;
        ASSERT_EQ(back.shape(), p.value.shape()) << p.name;
        EXPECT_EQ(std::memcmp(back.data<float>(), p.value.data<float>(), p.value.nbytes()), 0) << p.name;
      }
      fs::remove_all(out);
    }
  }
}

// A model trained with Multi-Token Prediction exports its main model: every other parameter loads back exactly and the
// logits are the same; the mtp.layers.* heads are left out.
TEST_F(HfCheckpointTest, MtpModelExportsTheMainModel) {
  ModelConfig c = llama_config();
  c.mtp_num_layers = 2;
  GPTModel model(c, 1);
  randomize(model, 7);
  const std::string out = path("export_mtp");
  export_hf(model, HfExportInfo{}, out);
  const std::unique_ptr<GPTModel> loaded = load_hf(out, HfImportOptions{.seq_length = c.seq_length});
  EXPECT_EQ(loaded->config().mtp_num_layers, 0);
  size_t main_params = 0;
  for (const Param& p : model.params()) {
    if (p.name.starts_with("mtp.")) continue;
    ++main_params;
    const Tensor& back = loaded->param(p.name).value;
    EXPECT_EQ(std::memcmp(back.data<float>(), p.value.data<float>(), p.value.nbytes()), 0) << p.name;
  }
  EXPECT_EQ(loaded->params().size(), main_params);
  const std::vector<int32_t> tokens = {5, 17, 3, 90, 41, 8};
  const Tensor a = model.last_logits(tokens.data(), 1, 6), b = loaded->last_logits(tokens.data(), 1, 6);
  EXPECT_EQ(std::memcmp(a.data<float>(), b.data<float>(), a.nbytes()), 0);
}

TEST_F(HfCheckpointTest, RefusesModelsHfCannotRepresent) {
  const auto expect_refusal = [](ModelConfig c, const std::string& detail) {
    try {
      hf_model_type(c);
      ADD_FAILURE() << "no error for " << detail;
    } catch (const ConfigError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("HF export supports llama/qwen3-style models"), std::string::npos) << message;
      EXPECT_NE(message.find(detail), std::string::npos) << message;
    }
  };
  ModelConfig c = llama_config();
  EXPECT_EQ(hf_model_type(c), "llama");
  c.qk_layernorm = true;
  EXPECT_EQ(hf_model_type(c), "qwen3");
  c = llama_config();
  c.normalization = Normalization::kLayerNorm;
  expect_refusal(c, "LayerNorm");
  c = llama_config();
  c.activation = Activation::kGelu;
  expect_refusal(c, "gelu");
  c = llama_config();
  c.position_embedding_type = PositionEmbedding::kLearnedAbsolute;
  expect_refusal(c, "learned_absolute");
  c = llama_config();
  c.rotary_percent = 0.5;
  expect_refusal(c, "--rotary-percent");
  c = llama_config();
  c.qk_layernorm = true;
  c.add_bias_linear = true;
  expect_refusal(c, "qk-layernorm");
}

TEST_F(HfCheckpointTest, ExportNeverReplacesAForeignFolder) {
  GPTModel model(llama_config(), 3);
  const std::string out = path("mine");
  fs::create_directories(out);
  write_text(out + "/notes.txt", "keep");
  EXPECT_THROW(export_hf(model, HfExportInfo{}, out), std::runtime_error);
  EXPECT_TRUE(fs::exists(out + "/notes.txt"));
  EXPECT_FALSE(fs::exists(out + "/config.json"));
  // A second export over a first one replaces it and leaves no temporary folder.
  const std::string ok = path("ok/");
  export_hf(model, HfExportInfo{}, ok);
  HfExportInfo other_ids;
  other_ids.bos_token_id = 1;
  other_ids.eos_token_id = 2;
  export_hf(model, other_ids, ok);
  EXPECT_FALSE(fs::exists(path("ok.tmp")));
  EXPECT_EQ(read_hf_config(ok).vocab_size, 96);
  std::ifstream gen(path("ok/generation_config.json"));
  const std::string text((std::istreambuf_iterator<char>(gen)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"eos_token_id\": 2"), std::string::npos) << text;
}

// A config.json as published for Llama-style checkpoints (fields of HF's LlamaConfig).
constexpr const char* kLlamaConfig = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
  "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 2048,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "rope_scaling": null, "vocab_size": 320,
  "tie_word_embeddings": false, "attention_bias": false, "mlp_bias": false, "hidden_act": "silu",
  "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"})";

TEST_F(HfCheckpointTest, ReadsLlamaAndQwen3Configs) {
  fs::create_directories(path("llama"));
  write_text(path("llama/config.json"), kLlamaConfig);
  const ModelConfig c = read_hf_config(path("llama"), HfImportOptions{.seq_length = 128});
  EXPECT_EQ(c.num_layers, 3);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.ffn_hidden_size, 176);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_query_groups, 2);
  EXPECT_EQ(c.kv_channels, 8);  // no head_dim: hidden_size / heads
  EXPECT_EQ(c.seq_length, 128);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_EQ(c.vocab_size, 320);
  EXPECT_EQ(c.normalization, Normalization::kRMSNorm);
  EXPECT_DOUBLE_EQ(c.norm_epsilon, 1e-5);
  EXPECT_EQ(c.activation, Activation::kSwiGLU);
  EXPECT_EQ(c.position_embedding_type, PositionEmbedding::kRope);
  EXPECT_DOUBLE_EQ(c.rotary_base, 10000.0);
  EXPECT_FALSE(c.add_bias_linear);
  EXPECT_FALSE(c.qk_layernorm);
  EXPECT_TRUE(c.untie_embeddings_and_output_weights);

  fs::create_directories(path("qwen3"));
  write_text(path("qwen3/config.json"), R"({"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 128,
    "tie_word_embeddings": true, "attention_bias": false, "use_sliding_window": false, "hidden_act": "silu"})");
  const ModelConfig q = read_hf_config(path("qwen3"));
  EXPECT_TRUE(q.qk_layernorm);
  EXPECT_EQ(q.kv_channels, 32);
  EXPECT_EQ(q.seq_length, 512);
  EXPECT_DOUBLE_EQ(q.rotary_base, 1e6);
  EXPECT_FALSE(q.untie_embeddings_and_output_weights);
}

TEST_F(HfCheckpointTest, ConfigProblemsNameTheFileAndField) {
  const auto with = [](const std::string& from, const std::string& to) {
    return test::replaced(kLlamaConfig, from, to);
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {with("\"model_type\": \"llama\"", "\"model_type\": \"gpt2\""), "model_type"},
      {with("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\""), "hidden_act"},
      {with("\"rope_scaling\": null", "\"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 2.0}"),
       "rope_scaling"},
      {with("\"mlp_bias\": false", "\"mlp_bias\": true"), "mlp_bias"},
      {with("\"hidden_size\": 64,", ""), "hidden_size"},
      {with("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"), "num-query-groups"},
      {with("\"vocab_size\": 320", "\"vocab_size\": \"many\""), "vocab_size"},
      // 2^33 layers (a layer pattern of 8 Gbit and a loop over it before), and a negative count
      {with("\"num_hidden_layers\": 3", "\"num_hidden_layers\": 8589934592"),
       "num_hidden_layers 8589934592 is outside [1, 1048576]"},
      {with("\"num_hidden_layers\": 3", "\"num_hidden_layers\": -1"), "num_hidden_layers -1 is outside [1, 1048576]"},
  };
  for (const auto& [text, phrase] : cases) expect_config_error(text, phrase);
  write_text(path("bad/config.json"), "{ not json");
  EXPECT_THROW(read_hf_config(path("bad")), std::runtime_error);
  EXPECT_THROW(read_hf_config(path("nowhere")), std::runtime_error);
}

// Integer fields are integers in range: nlohmann would truncate 2.5 to 2 and turn 2^70 (a double) into garbage.
TEST_F(HfCheckpointTest, IntegerFieldsMustBeIntegersInRange) {
  const auto with = [](const std::string& from, const std::string& to) {
    return test::replaced(kLlamaConfig, from, to);
  };
  const std::string file = path("bad") + "/config.json";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {with("\"num_hidden_layers\": 3", "\"num_hidden_layers\": 2.5"),
       file + ": field 'num_hidden_layers' must be an integer (got 2.5)"},
      {with("\"num_hidden_layers\": 3", "\"num_hidden_layers\": 3.0"),
       file + ": field 'num_hidden_layers' must be an integer (got 3.0)"},
      {with("\"hidden_size\": 64", "\"hidden_size\": 1180591620717411303424"),  // 2^70
       file + ": field 'hidden_size' is out of range (got 1.1805916207174113e+21)"},
      {with("\"vocab_size\": 320", "\"vocab_size\": 9223372036854775808"),  // 2^63: uint64, not int64
       file + ": field 'vocab_size' is out of range (got 9223372036854775808)"},
      {with("\"num_key_value_heads\": 2", "\"num_key_value_heads\": true"),
       file + ": field 'num_key_value_heads' must be an integer (got true)"},
  };
  for (const auto& [text, expected] : cases) EXPECT_EQ(config_error(text), expected);
}

// The export's folder rules, checkable before training: absent, or an earlier export (replaced whole); never a file
// or a folder with other files, also as DIR.tmp.
TEST_F(HfCheckpointTest, ExportFolderProblemsAreKnownBeforeExporting) {
  EXPECT_EQ(hf_export_dir_problem(path("fresh")), "");
  EXPECT_EQ(hf_export_dir_problem(path("a/b/c")), "");  // parents are created
  GPTModel model(llama_config(), 3);
  export_hf(model, HfExportInfo{}, path("earlier"));
  EXPECT_EQ(hf_export_dir_problem(path("earlier")), "");
  write_text(path("file"), "x");
  EXPECT_EQ(hf_export_dir_problem(path("file")), path("file") + " exists and is not a folder");
  fs::create_directories(path("notes"));
  write_text(path("notes/notes.txt"), "keep");
  EXPECT_EQ(hf_export_dir_problem(path("notes")),
            "refusing to replace " + path("notes") + ": it holds 'notes.txt', which an export does not write");
  fs::create_directories(path("out.tmp"));
  write_text(path("out.tmp/x"), "x");
  EXPECT_NE(hf_export_dir_problem(path("out")).find("refusing to replace " + path("out.tmp")), std::string::npos);
  EXPECT_EQ(hf_export_dir_problem(""), "empty output folder name");
  const std::string unwritable = hf_export_dir_problem("/proc/moecore_export");  // /proc takes no files, even root's
  EXPECT_EQ(unwritable.rfind("cannot create a file in /proc: ", 0), 0u) << unwritable;
}

TEST_F(HfCheckpointTest, LoadRejectsMissingAndMisshapenTensors) {
  GPTModel model(llama_config(), 5);
  const std::string out = path("export");
  export_hf(model, HfExportInfo{}, out);
  SafetensorsFile file = read_safetensors(out + "/model.safetensors");
  // Drop one tensor.
  std::vector<NamedTensor> fewer(file.tensors.begin() + 1, file.tensors.end());
  const std::string dropped = file.tensors.front().first;
  write_safetensors(out + "/model.safetensors", fewer);
  try {
    load_hf(out);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dropped), std::string::npos) << e.what();
  }
  // Wrong shape.
  std::vector<NamedTensor> wrong = file.tensors;
  wrong[0].second = Tensor({3, 3}, DType::kF32);
  write_safetensors(out + "/model.safetensors", wrong);
  try {
    load_hf(out);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("[3, 3]"), std::string::npos) << e.what();
  }
  // An unknown extra tensor.
  std::vector<NamedTensor> extra = file.tensors;
  extra.emplace_back("model.layers.9.mystery.weight", Tensor({2}, DType::kF32));
  write_safetensors(out + "/model.safetensors", extra);
  try {
    load_hf(out);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("mystery"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moecore
