// An HF folder as a StateSource (hf_state_source) and the flags-vs-config.json check (check_hf_config_matches):
// - model_state_keys lists exactly the keys, global shapes and initialisers of built models (dense and MoE variants);
// - for every architecture (llama, qwen3, mixtral, qwen3_moe, moecore_moe) an export loads through the source into a
//   fresh model initialised with another seed, every parameter and buffer (each expert's) bit for bit;
// - a sharded folder (two files + model.safetensors.index.json, written here by hand, in bf16 and fp16) loads, with
//   each value the dtype's rounding of the original;
// - tensors are read when a key is loaded (the source holds no values);
// - a tensor-parallel placement (two shards, SwiGLU's two segments; a column cut) receives its slice;
// - a config.json that disagrees with the flags gives one line naming the field and the flag; a missing tensor is
//   named.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "moecore/ckpt/hf_checkpoint.h"
#include "moecore/ckpt/hf_state_source.h"
#include "moecore/ckpt/model_state_keys.h"
#include "moecore/ckpt/safetensors.h"
#include "moecore/ckpt/state_dict.h"
#include "unit/hf_fixture.h"
#include "unit/test_temp_dir.h"

namespace moecore {
namespace {

using json = nlohmann::json;

// The shared llama-style model with linear biases (tied output).
ModelConfig llama_config() {
  ModelConfig c = test::hf_llama_config();
  c.add_bias_linear = true;
  return c;
}

ModelConfig qwen3_config() {
  ModelConfig c = llama_config();
  c.add_bias_linear = false;
  c.qk_layernorm = true;
  c.untie_embeddings_and_output_weights = true;
  return c;
}

ModelConfig mixtral_config() { return test::hf_moe_config(2); }

ModelConfig qwen3_moe_config() {
  ModelConfig c = test::hf_moe_config(3);
  c.qk_layernorm = true;
  c.untie_embeddings_and_output_weights = false;
  c.moe.moe_layer_pattern = {false, true, true};
  c.moe.num_experts = 6;
  c.moe.ffn_hidden_size = 16;
  c.moe.pre_softmax = true;
  return c;
}

// DeepSeek-V3-like without MLA: sigmoid scores, groups, expert bias, scaling factor, a gated shared expert, a dense
// first layer, linear biases (no: shared experts need --disable-bias-linear) and q/k norms.
ModelConfig moecore_moe_config() {
  ModelConfig c = test::hf_deepseek_like_config();
  c.qk_layernorm = true;
  return c;
}

// DeepSeek-V3 in miniature: multi-latent attention with a q latent, YaRN (DeepSeek-V3's factor 40 and mscales),
// sigmoid routing over 4 groups (top 2 groups for top-4 experts), expert bias, scaling factor, one shared expert and a
// dense first layer, and one Multi-Token Prediction depth.
ModelConfig deepseek_v3_config() {
  ModelConfig c = test::hf_moe_config(3);
  c.qk_layernorm = true;
  c.mla = MlaConfig{24, 16, 8, 4, 12, RopeType::kYarn};
  c.num_query_groups = c.num_attention_heads;  // no GQA with multi-latent attention
  c.yarn.rotary_scaling_factor = 40.0;
  c.yarn.mscale = 1.0;
  c.yarn.mscale_all_dim = 1.0;
  c.moe.moe_layer_pattern = {false, true, true};
  c.moe.num_experts = 8;
  c.moe.topk = 4;
  c.moe.score_function = RouterScoreFunction::kSigmoid;
  c.moe.num_groups = 4;
  c.moe.group_topk = 2;
  c.moe.enable_expert_bias = true;
  c.moe.topk_scaling_factor = 2.5;
  c.moe.shared_expert_intermediate_size = 24;
  c.moe.load_balancing_types = {LoadBalancingType::kSeqAuxLoss};
  c.moe.aux_loss_coeffs = {1e-4};
  c.mtp_num_layers = 1;  // HF layer 3
  return c;
}

struct Architecture {
  std::string model_type;
  ModelConfig config;
};

std::vector<Architecture> architectures() {
  return {{"llama", llama_config()},
          {"qwen3", qwen3_config()},
          {"mixtral", mixtral_config()},
          {"qwen3_moe", qwen3_moe_config()},
          {"moecore_moe", moecore_moe_config()},
          {"deepseek_v3", deepseek_v3_config()}};
}

// Distinct random values in every parameter and buffer, so a misplaced row cannot go unnoticed.
void randomize(GPTModel& model, const uint64_t seed) { test::randomize(model, seed, test::RandomBuffers::kYes); }

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.data<std::byte>(), b.data<std::byte>(), a.nbytes()) == 0;
}

void load_into(const GlobalTensorSource& source, GPTModel& model) {
  StateDict state;
  add_model_state(state, model);
  load_state(source, state);
}

void expect_same_state(const GPTModel& expected, const GPTModel& actual) {
  ASSERT_EQ(expected.params().size(), actual.params().size());
  for (const Param& p : expected.params()) EXPECT_TRUE(bit_equal(p.value, actual.param(p.name).value)) << p.name;
  ASSERT_EQ(expected.named_buffers().size(), actual.named_buffers().size());
  for (const Buffer& b : expected.named_buffers()) {
    EXPECT_TRUE(bit_equal(b.value, actual.buffer(b.name).value)) << b.name;
  }
}

TEST(ModelStateKeys, MatchBuiltModels) {
  ModelConfig gpt2 = llama_config();  // LayerNorm (with biases), learned positions, GeLU, linear biases
  gpt2.normalization = Normalization::kLayerNorm;
  gpt2.activation = Activation::kGelu;
  gpt2.position_embedding_type = PositionEmbedding::kLearnedAbsolute;
  gpt2.qk_layernorm = true;
  ModelConfig relu2_moe = qwen3_moe_config();
  relu2_moe.activation = Activation::kSquaredReLU;
  relu2_moe.add_bias_linear = true;      // router bias, expert biases
  ModelConfig mla = qwen3_moe_config();  // multi-latent attention with a q latent and its norms
  mla.mla = MlaConfig{24, 16, 8, 4, 12, RopeType::kYarn};
  mla.qk_layernorm = true;
  ModelConfig mla_plain = gpt2;  // multi-latent attention without a q latent or norms, with linear biases
  mla_plain.mla = MlaConfig{0, 16, 8, 4, 12, RopeType::kRope};
  mla_plain.qk_layernorm = false;
  // Multi-Token Prediction depths after the head (MoE depth layers with expert-bias buffers; LayerNorm, untied; MLA).
  ModelConfig mtp_moe = qwen3_moe_config();
  mtp_moe.mtp_num_layers = 2;
  mtp_moe.moe.enable_expert_bias = true;
  mtp_moe.moe.score_function = RouterScoreFunction::kSigmoid;
  ModelConfig mtp_layernorm = gpt2;
  mtp_layernorm.mtp_num_layers = 1;
  mtp_layernorm.untie_embeddings_and_output_weights = true;
  ModelConfig mtp_mla = mla;
  mtp_mla.mtp_num_layers = 1;
  std::vector<ModelConfig> configs = {gpt2, relu2_moe, mla, mla_plain, mtp_moe, mtp_layernorm, mtp_mla};
  for (const Architecture& a : architectures()) configs.push_back(a.config);
  for (const ModelConfig& c : configs) {
    const GPTModel model(c, 3);
    StateDict state;
    add_model_state(state, model);
    const std::vector<ModelStateKey> keys = model_state_keys(c);
    ASSERT_EQ(keys.size(), state.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      const StateEntry& entry = state.entries()[i];
      EXPECT_EQ(keys[i].key, entry.key);
      EXPECT_EQ(keys[i].global_shape, entry.global_shape) << entry.key;
      bool is_buffer = false;
      for (const Buffer& b : model.named_buffers()) is_buffer |= b.name == entry.key;
      EXPECT_EQ(keys[i].buffer, is_buffer) << entry.key;
      if (!keys[i].buffer) {
        EXPECT_EQ(keys[i].init, model.param(entry.key).init) << entry.key;
      }
    }
  }
}

TEST(HfStateSource, EveryArchitectureLoadsBitExactIntoAnotherSeedsModel) {
  const test::TempDir tmp("hf_state_source");
  for (const Architecture& a : architectures()) {
    SCOPED_TRACE(a.model_type);
    GPTModel original(a.config, 1);
    randomize(original, 7);
    const std::string dir = tmp.path(a.model_type);
    export_hf(original, HfExportInfo{}, dir);
    ASSERT_EQ(read_hf_model_type(dir), a.model_type);
    EXPECT_NO_THROW(check_hf_config_matches(dir, a.config));

    const std::unique_ptr<GlobalTensorSource> source = hf_state_source(dir, a.config);
    std::vector<std::string> expected_keys;
    for (const ModelStateKey& k : model_state_keys(a.config)) expected_keys.push_back(k.key);
    EXPECT_EQ(source->keys(), expected_keys);

    GPTModel fresh(a.config, 2);
    ASSERT_FALSE(bit_equal(fresh.params().front().value, original.params().front().value));
    load_into(*source, fresh);
    expect_same_state(original, fresh);
  }
}

TEST(HfStateSource, ShardedFolderInBf16AndFp16) {
  const test::TempDir tmp("hf_state_source");
  const ModelConfig c = qwen3_moe_config();
  GPTModel original(c, 1);
  randomize(original, 9);
  const std::string dir = tmp.path("sharded");
  export_hf(original, HfExportInfo{}, dir);
  const SafetensorsFile whole = read_safetensors(dir + "/model.safetensors");
  std::filesystem::remove(dir + "/model.safetensors");

  // The first half of the tensors in bf16, the rest in fp16, each shard named in the index's weight_map.
  std::vector<NamedTensor> first, second;
  json weight_map = json::object();
  for (size_t i = 0; i < whole.tensors.size(); ++i) {
    const auto& [name, value] = whole.tensors[i];
    const bool in_first = i < whole.tensors.size() / 2;
    Tensor converted(value.shape(), in_first ? DType::kBF16 : DType::kF16);
    for (int64_t k = 0; k < value.numel(); ++k) {
      const float x = value.data<float>()[k];
      converted.data<uint16_t>()[k] = in_first ? fp32_to_bf16(x) : fp32_to_fp16(x);
    }
    (in_first ? first : second).emplace_back(name, converted);
    weight_map[name] = in_first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  write_safetensors(dir + "/model-00001-of-00002.safetensors", first);
  write_safetensors(dir + "/model-00002-of-00002.safetensors", second);
  std::ofstream(dir + "/model.safetensors.index.json")
      << json{{"metadata", json::object()}, {"weight_map", weight_map}};

  // Expected: the original model with each value rounded through its shard's dtype.
  GPTModel expected(c, 1);
  {
    std::vector<NamedTensor> rounded;
    for (const auto& [name, value] : first) rounded.emplace_back(name, to_float32(value));
    for (const auto& [name, value] : second) rounded.emplace_back(name, to_float32(value));
    const std::string single = tmp.path("rounded");
    export_hf(original, HfExportInfo{}, single);
    write_safetensors(single + "/model.safetensors", rounded);
    load_into(*hf_state_source(single, c), expected);
  }
  int64_t changed = 0;  // the rounding really happened
  for (const Param& p : original.params()) changed += !bit_equal(p.value, expected.param(p.name).value);
  EXPECT_EQ(changed, static_cast<int64_t>(original.params().size()));
  // Spot-check the expected values against the conversions themselves.
  const float x = original.param("embedding.word_embeddings.weight").value.data<float>()[5];
  const float loaded_x = expected.param("embedding.word_embeddings.weight").value.data<float>()[5];
  EXPECT_TRUE(loaded_x == bf16_to_fp32(fp32_to_bf16(x)) || loaded_x == fp16_to_fp32(fp32_to_fp16(x)));

  GPTModel fresh(c, 2);
  load_into(*hf_state_source(dir, c), fresh);
  expect_same_state(expected, fresh);
}

TEST(HfStateSource, ReadsTensorsWhenAKeyIsLoaded) {
  const test::TempDir tmp("hf_state_source");
  const ModelConfig c = llama_config();
  GPTModel original(c, 1);
  randomize(original, 3);
  const std::string dir = tmp.path("lazy");
  export_hf(original, HfExportInfo{}, dir);
  const std::unique_ptr<GlobalTensorSource> source = hf_state_source(dir, c);
  // Same header (names, shapes, offsets), new values: a source that had read the file would not see them.
  SafetensorsFile file = read_safetensors(dir + "/model.safetensors");
  for (auto& [name, value] : file.tensors) {
    for (float& v : value.span<float>()) v *= 2.0f;
  }
  write_safetensors(dir + "/model.safetensors", file.tensors, file.metadata);
  const Tensor embedding = read_global_tensor(*source, "embedding.word_embeddings.weight");
  const Tensor& before = original.param("embedding.word_embeddings.weight").value;
  for (int64_t i = 0; i < embedding.numel(); ++i) {
    ASSERT_EQ(embedding.data<float>()[i], 2.0f * before.data<float>()[i]) << i;
  }
}

TEST(HfStateSource, TensorParallelPlacementsReceiveTheirSlices) {
  const test::TempDir tmp("hf_state_source");
  const ModelConfig c = llama_config();
  GPTModel original(c, 1);
  randomize(original, 5);
  const std::string dir = tmp.path("tp");
  export_hf(original, HfExportInfo{}, dir);
  const std::unique_ptr<GlobalTensorSource> source = hf_state_source(dir, c);

  // Rank 1 of TP=2: fc1's rows (gate and up halves cut separately), linear_proj's columns, the qkv bias's rows.
  struct Case {
    std::string key;
    int dim, segments;
  };
  for (const Case& k : {Case{"decoder.layers.1.mlp.linear_fc1.weight", 0, 2},
                        Case{"decoder.layers.0.self_attention.linear_proj.weight", 1, 1},
                        Case{"decoder.layers.0.self_attention.linear_qkv.bias", 0, 1}}) {
    SCOPED_TRACE(k.key);
    const Tensor& full = original.param(k.key).value;
    StatePlacement placement;
    placement.shard = ParamShard{k.dim, k.segments, 2, 1, full.shape()};
    StateDict state;
    state.add_tensor(k.key, Tensor(shard_shape(placement.shard), DType::kF32), placement);
    load_state(*source, state);
    const Tensor& local = state.entries().front().local;
    ASSERT_EQ(local.numel() * 2, full.numel());
    for (int64_t i = 0; i < local.numel(); ++i) {
      ASSERT_EQ(local.data<float>()[i], full.data<float>()[global_index(placement, i)]) << i;
    }
  }
  // The SwiGLU slice by hand: rank 1 holds gate rows [F/2, F) then up rows [F + F/2, 2F).
  StatePlacement fc1;
  const Tensor& full = original.param("decoder.layers.1.mlp.linear_fc1.weight").value;
  fc1.shard = ParamShard{0, 2, 2, 1, full.shape()};
  StateDict state;
  state.add_tensor("decoder.layers.1.mlp.linear_fc1.weight", Tensor(shard_shape(fc1.shard), DType::kF32), fc1);
  load_state(*source, state);
  const int64_t F = c.ffn_hidden_size, H = c.hidden_size;
  const float* local = state.entries().front().local.data<float>();
  EXPECT_EQ(local[0], full.data<float>()[(F / 2) * H]);
  EXPECT_EQ(local[(F / 2) * H], full.data<float>()[(F + F / 2) * H]);
}

TEST(HfStateSource, ConfigMismatchNamesTheFieldAndTheFlag) {
  const test::TempDir tmp("hf_state_source");
  const std::string dense_dir = tmp.path("llama"), moe_dir = tmp.path("qwen3_moe");
  export_hf(GPTModel(llama_config(), 1), HfExportInfo{}, dense_dir);
  export_hf(GPTModel(qwen3_moe_config(), 1), HfExportInfo{}, moe_dir);
  const auto expect_line = [](const std::string& dir, const ModelConfig& flags, const std::string& line) {
    try {
      check_hf_config_matches(dir, flags);
      ADD_FAILURE() << "no error, expected: " << line;
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()), line);
    }
  };
  ModelConfig c = llama_config();
  c.hidden_size = 64;
  expect_line(dense_dir, c, "HF config.json hidden_size 32 does not match --hidden-size 64");
  c = llama_config();
  c.vocab_size = 128;
  expect_line(dense_dir, c,
              "HF config.json vocab_size 80 does not match the padded vocabulary size 128 (the tokenizer's "
              "vocabulary padded by --make-vocab-size-divisible-by)");
  c = llama_config();
  c.norm_epsilon = 1e-5;
  expect_line(dense_dir, c, "HF config.json rms_norm_eps 1e-06 does not match --norm-epsilon 1e-05");
  c = llama_config();
  c.untie_embeddings_and_output_weights = true;
  expect_line(dense_dir, c,
              "HF config.json tie_word_embeddings true does not match --untie-embeddings-and-output-weights");
  c = llama_config();
  c.num_query_groups = 4;
  expect_line(dense_dir, c, "HF config.json num_key_value_heads 2 does not match --num-query-groups 4");
  c = llama_config();
  c.qk_layernorm = true;
  expect_line(dense_dir, c, "HF config.json model_type llama (no q/k norms) does not match --qk-layernorm");
  c = llama_config();
  c.moe = test::hf_moe_config(2).moe;
  expect_line(dense_dir, c, "HF config.json model_type llama (dense) does not match --num-experts 4");

  c = qwen3_moe_config();
  c.moe.num_experts = 8;
  expect_line(moe_dir, c, "HF config.json num_experts 6 does not match --num-experts 8");
  c = qwen3_moe_config();
  c.moe.ffn_hidden_size = 32;
  expect_line(moe_dir, c, "HF config.json moe_intermediate_size 16 does not match --moe-ffn-hidden-size 32");
  c = qwen3_moe_config();
  c.moe.moe_layer_pattern = {true, true, true};
  expect_line(moe_dir, c, "HF config.json mlp_only_layers [0] does not match --moe-layer-freq (dense layers [])");
  c = qwen3_moe_config();
  c.moe.pre_softmax = false;
  expect_line(moe_dir, c, "HF config.json norm_topk_prob false does not match no --moe-router-pre-softmax");
  c = qwen3_moe_config();
  c.ffn_hidden_size = 64;
  expect_line(moe_dir, c, "HF config.json intermediate_size 48 does not match --ffn-hidden-size 64");
  // Training-only settings are not compared.
  c = qwen3_moe_config();
  c.seq_length = 32;
  c.hidden_dropout = 0.1;
  c.moe.capacity_factor = 1.5;
  c.moe.aux_loss_coeffs = {0.5};
  EXPECT_NO_THROW(check_hf_config_matches(moe_dir, c));
}

TEST(HfStateSource, MissingTensorIsNamed) {
  const test::TempDir tmp("hf_state_source");
  const ModelConfig c = mixtral_config();
  const std::string dir = tmp.path("missing");
  export_hf(GPTModel(c, 1), HfExportInfo{}, dir);
  SafetensorsFile file = read_safetensors(dir + "/model.safetensors");
  const std::string dropped = "model.layers.1.block_sparse_moe.experts.3.w3.weight";
  std::vector<NamedTensor> fewer;
  for (const auto& t : file.tensors) {
    if (t.first != dropped) fewer.push_back(t);
  }
  ASSERT_EQ(fewer.size() + 1, file.tensors.size());
  write_safetensors(dir + "/model.safetensors", fewer);
  test::expect_error_containing<std::runtime_error>([&] { hf_state_source(dir, c); },
                                                    "missing tensor '" + dropped + "'");
}

}  // namespace
}  // namespace moecore
