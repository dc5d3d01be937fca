#include "moecore/train/checkpoint_contents.h"

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "moecore/ckpt/model_state_keys.h"

namespace moecore {
namespace {

using ojson = nlohmann::ordered_json;

// Sizes beyond this are no model moecore trains, and products of two of them stay far inside int64.
constexpr int64_t kMaxRecordedSize = int64_t{1} << 30;

std::string metadata_path(const ShardedCheckpoint& checkpoint) {
  return (std::filesystem::path(checkpoint.dir()) / "metadata.json").string();
}

class FlagReader {
 public:
  FlagReader(const ojson& flags, std::string path) : flags_(flags), path_(std::move(path)) {}

  const ojson& value(const std::string& flag) const {
    const auto it = flags_.find(flag);
    if (it == flags_.end()) fail(flag, "is missing");
    return *it;
  }
  int64_t size(const std::string& flag) const {
    const ojson& v = value(flag);
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxRecordedSize) {
      fail(flag, "must be an integer in [0, 2^30], got " + json_value_text(v));
    }
    return v.get<int64_t>();
  }
  bool boolean(const std::string& flag) const {
    const ojson& v = value(flag);
    if (!v.is_boolean()) fail(flag, "must be true or false, got " + json_value_text(v));
    return v.get<bool>();
  }
  std::string text(const std::string& flag, const std::vector<std::string>& allowed) const {
    const ojson& v = value(flag);
    for (const std::string& a : allowed) {
      if (v.is_string() && v.get<std::string>() == a) return a;
    }
    std::string choices;
    for (const std::string& a : allowed) choices += (choices.empty() ? "" : ", ") + a;
    fail(flag, "must be one of " + choices + ", got " + json_value_text(v));
  }
  [[noreturn]] void fail(const std::string& flag, const std::string& problem) const {
    throw CheckpointError(path_ + ": \"args.model." + flag + "\" " + problem);
  }

 private:
  const ojson& flags_;
  std::string path_;
};

}  // namespace

const ojson& recorded_model_flags(const ShardedCheckpoint& checkpoint) {
  const ojson& args = checkpoint.metadata().at("args");  // an object: the format's validation checked it
  const auto it = args.find("model");
  if (it == args.end()) {
    throw CheckpointError(metadata_path(checkpoint) +
                          ": \"args.model\" is missing (the model flags a run loading it must repeat)");
  }
  return *it;
}

ModelConfig recorded_model_config(const ShardedCheckpoint& checkpoint) {
  const FlagReader flags(recorded_model_flags(checkpoint), metadata_path(checkpoint));
  ModelConfig c;
  c.num_layers = flags.size("--num-layers");
  c.hidden_size = flags.size("--hidden-size");
  c.ffn_hidden_size = flags.size("--ffn-hidden-size");
  c.num_attention_heads = flags.size("--num-attention-heads");
  c.num_query_groups = flags.size("--num-query-groups");
  c.kv_channels = flags.size("--kv-channels");
  c.normalization = flags.text("--normalization", {"LayerNorm", "RMSNorm"}) == "LayerNorm" ? Normalization::kLayerNorm
                                                                                           : Normalization::kRMSNorm;
  c.activation = flags.boolean("--swiglu") ? Activation::kSwiGLU : Activation::kGelu;
  c.add_bias_linear = flags.boolean("--add-bias-linear");
  c.qk_layernorm = flags.boolean("--qk-layernorm");
  const std::string position = flags.text("--position-embedding-type", {"rope", "yarn", "none", "learned_absolute"});
  c.position_embedding_type = position == "rope"   ? PositionEmbedding::kRope
                              : position == "yarn" ? PositionEmbedding::kYarn
                              : position == "none" ? PositionEmbedding::kNone
                                                   : PositionEmbedding::kLearnedAbsolute;
  if (recorded_model_flags(checkpoint).contains("--multi-latent-attention") &&
      flags.boolean("--multi-latent-attention")) {
    MlaConfig mla;
    mla.q_lora_rank = flags.size("--q-lora-rank");
    mla.kv_lora_rank = flags.size("--kv-lora-rank");
    mla.qk_head_dim = flags.size("--qk-head-dim");
    mla.qk_pos_emb_head_dim = flags.size("--qk-pos-emb-head-dim");
    mla.v_head_dim = flags.size("--v-head-dim");
    mla.rope_type = flags.text("--rope-type", {"rope", "yarn"}) == "rope" ? RopeType::kRope : RopeType::kYarn;
    c.mla = mla;
  }
  if (c.position_embedding_type == PositionEmbedding::kLearnedAbsolute) {
    c.max_position_embeddings = flags.size("--max-position-embeddings");
  }
  c.untie_embeddings_and_output_weights = flags.boolean("--untie-embeddings-and-output-weights");
  if (recorded_model_flags(checkpoint).contains("--mtp-num-layers")) c.mtp_num_layers = flags.size("--mtp-num-layers");
  c.moe.num_experts = flags.size("--num-experts");
  if (c.moe.enabled()) {
    c.moe.ffn_hidden_size = flags.size("--moe-ffn-hidden-size");
    const ojson& pattern = flags.value("--moe-layer-freq");
    const bool pattern_ok = pattern.is_string() &&
                            pattern.get<std::string>().size() == static_cast<size_t>(c.num_layers) &&
                            pattern.get<std::string>().find_first_not_of("01") == std::string::npos;
    if (!pattern_ok) {
      flags.fail("--moe-layer-freq",
                 "must be a string of " + std::to_string(c.num_layers) + " 0s and 1s, got " + json_value_text(pattern));
    }
    for (const char layer : pattern.get<std::string>()) c.moe.moe_layer_pattern.push_back(layer == '1');
    c.moe.enable_expert_bias = flags.boolean("--moe-router-enable-expert-bias");
    c.moe.shared_expert_intermediate_size = flags.size("--moe-shared-expert-intermediate-size");
    c.moe.shared_expert_gate = flags.boolean("--moe-shared-expert-gate");
    if (recorded_model_flags(checkpoint).contains("--moe-latent-size")) {
      c.moe.latent_size = flags.size("--moe-latent-size");
    }
  }
  const ojson& args = checkpoint.metadata().at("args");
  if (args.contains("training") && args["training"].contains("padded_vocab_size")) {
    const ojson& vocab = args["training"]["padded_vocab_size"];
    if (!vocab.is_number_integer() || vocab.get<int64_t>() < 0 || vocab.get<int64_t>() > kMaxRecordedSize) {
      throw CheckpointError(metadata_path(checkpoint) +
                            ": \"args.training.padded_vocab_size\" must be an integer in [0, 2^30], got " +
                            json_value_text(vocab));
    }
    c.vocab_size = vocab.get<int64_t>();
  }
  return c;
}

void check_checkpoint_contents(const ShardedCheckpoint& checkpoint) {
  const std::string path = metadata_path(checkpoint);
  const ModelConfig config = recorded_model_config(checkpoint);
  const int64_t stored = static_cast<int64_t>(checkpoint.keys().size());
  // Each layer has at least 4 tensors, each MoE layer 2 per expert: flags asking for more than the checkpoint holds
  // are refused before their keys are listed.
  int64_t moe_layers = 0;
  for (const bool moe : config.moe.moe_layer_pattern) moe_layers += moe ? 1 : 0;
  if (config.num_layers * 4 > stored || moe_layers * config.moe.num_experts * 2 > stored) {
    throw CheckpointError(path + ": its model flags (" + std::to_string(config.num_layers) + " layers, " +
                          std::to_string(config.moe.num_experts) + " experts) imply more tensors than the " +
                          std::to_string(stored) + " it holds");
  }
  const auto require = [&](const std::string& key, const std::vector<int64_t>& shape, const bool vocab_rows_free) {
    const std::optional<StoredTensorInfo> info = checkpoint.info(key);
    if (!info) throw CheckpointError(path + ": no tensor " + key + " (a load of this checkpoint reads it)");
    const bool same = info->global_shape == shape ||
                      (vocab_rows_free && !shape.empty() && info->global_shape.size() == shape.size() &&
                       std::equal(shape.begin() + 1, shape.end(), info->global_shape.begin() + 1));
    if (!same) {
      throw CheckpointError(path + ": tensor " + key + " has shape " + shape_text(info->global_shape) +
                            ", its model flags (args.model) imply " + shape_text(shape));
    }
  };
  const bool has_optimizer = checkpoint.info("optimizer.step").has_value();
  for (const ModelStateKey& key : model_state_keys(config)) {
    // Without a recorded padded vocabulary, the vocabulary's rows are free (a load accepts other row counts too).
    const bool vocab_rows_free =
        config.vocab_size == 0 && (key.key == "embedding.word_embeddings.weight" || key.key == "output_layer.weight");
    require(key.key, key.global_shape, vocab_rows_free);
    if (has_optimizer && !key.buffer) {
      for (const char* moment : {"optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq."}) {
        require(moment + key.key, key.global_shape, vocab_rows_free);
      }
    }
  }
  std::vector<std::string> scalars = {"iteration", "consumed_train_samples", "consumed_valid_samples",
                                      "num_floating_point_operations_so_far"};
  if (has_optimizer) {
    for (const char* name :
         {"optimizer.step", "lr_scheduler.max_lr", "lr_scheduler.min_lr", "lr_scheduler.lr_warmup_steps",
          "lr_scheduler.lr_decay_steps", "lr_scheduler.num_steps", "lr_scheduler.lr_decay_style"}) {
      scalars.emplace_back(name);
    }
  }
  if (checkpoint.info("rng.seed")) scalars.emplace_back("rng.seed");
  for (const std::string& key : scalars) require(key, {}, false);
}

}  // namespace moecore
