#include "moecore/moe/routing_replay.h"

#include <algorithm>
#include <filesystem>
#include <utility>

namespace moecore {
namespace {

std::string list_text(const std::vector<int64_t>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) text += (i > 0 ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

// "" when `recording` routes this model's routers, else the mismatch.
std::string model_mismatch(const RoutingRecording& recording, const ModelConfig& config) {
  const std::vector<int64_t> layers = moe_router_layers(config);
  if (recording.router_layers != layers) {
    return "recorded for MoE layers " + list_text(recording.router_layers) + ", this model's are " + list_text(layers);
  }
  if (recording.topk != config.moe.topk) {
    return "recorded with top-" + std::to_string(recording.topk) + " routing, this model has --moe-router-topk " +
           std::to_string(config.moe.topk);
  }
  if (recording.num_experts != config.moe.num_experts) {
    return "recorded over " + std::to_string(recording.num_experts) + " experts, this model has --num-experts " +
           std::to_string(config.moe.num_experts);
  }
  return "";
}

uint64_t fnv1a(const std::span<const int32_t> tokens) {
  uint64_t hash = 14695981039346656037ULL;
  for (const int32_t token : tokens) {
    auto bits = static_cast<uint32_t>(token);
    for (int i = 0; i < 4; ++i) {
      hash ^= bits & 0xFF;
      hash *= 1099511628211ULL;
      bits >>= 8;
    }
  }
  return hash;
}

}  // namespace

std::vector<int64_t> moe_router_layers(const ModelConfig& config) {
  std::vector<int64_t> layers;
  for (int64_t layer = 0; layer < config.num_layers; ++layer) {
    if (config.moe.is_moe_layer(layer)) layers.push_back(layer);
  }
  return layers;
}

Tensor RoutingReplayBatch::local_selection(const int64_t router, const TokenRows& rows, const int64_t T) const {
  Tensor selected_TK = Tensor::uninitialized({T, topk}, DType::kI32, MemCategory::kActivations);
  int32_t* out = selected_TK.data<int32_t>();
  const auto copy_rows = [&](const int64_t local, const int64_t global, const int64_t count) {
    if (global < 0 || global + count > S * B || local + count > T) {
      throw std::out_of_range("router replay: rows outside the micro-batch's recorded table");
    }
    for (int64_t i = 0; i < count; ++i) {
      const int32_t* from = experts.data() + ((global + i) * routers + router) * topk;
      std::copy(from, from + topk, out + (local + i) * topk);
    }
  };
  if (rows.runs().empty()) {
    copy_rows(0, 0, T);
  } else {
    for (const TokenRows::Run& run : rows.runs()) copy_rows(run.local, run.global, run.count);
  }
  return selected_TK;
}

RoutingReplaySource::RoutingReplaySource(const std::string& path, const ModelConfig& config, const bool whole_samples)
    : path_(path), S_(config.seq_length), recording_(read_routing_recording(path)) {
  if (const std::string mismatch = model_mismatch(recording_, config); !mismatch.empty()) {
    throw ConfigError("routing recording " + path + ": " + mismatch);
  }
  if (whole_samples) {
    for (size_t i = 0; i < recording_.records.size(); ++i) by_tokens_.emplace(fnv1a(recording_.records[i].tokens), i);
    return;
  }
  for (size_t i = 0; i < recording_.records.size(); ++i) {
    const RoutingRecord& record = recording_.records[i];
    if (record.routed < S_) continue;  // too short to route a training sample
    by_prefix_.emplace(fnv1a(std::span<const int32_t>(record.tokens).first(static_cast<size_t>(S_))), i);
  }
  if (by_prefix_.empty()) {
    throw ConfigError("routing recording " + path + ": none of its " + std::to_string(recording_.records.size()) +
                      " records routes " + std::to_string(S_) + " tokens (--seq-length)");
  }
}

const RoutingRecord* RoutingReplaySource::find(const std::span<const int32_t> tokens_S) const {
  const auto [begin, end] = by_prefix_.equal_range(fnv1a(tokens_S));
  const RoutingRecord* first = nullptr;
  size_t first_index = 0;
  for (auto it = begin; it != end; ++it) {
    const RoutingRecord& record = recording_.records[it->second];
    if (!std::equal(tokens_S.begin(), tokens_S.end(), record.tokens.begin())) continue;
    if (first == nullptr || it->second < first_index) {
      first = &record;
      first_index = it->second;
    }
  }
  return first;
}

const RoutingRecord* RoutingReplaySource::find_sample(const std::span<const int32_t> tokens) const {
  const auto [begin, end] = by_tokens_.equal_range(fnv1a(tokens));
  const RoutingRecord* first = nullptr;
  size_t first_index = 0;
  for (auto it = begin; it != end; ++it) {
    const RoutingRecord& record = recording_.records[it->second];
    if (!std::equal(tokens.begin(), tokens.end(), record.tokens.begin(), record.tokens.end())) continue;
    if (first == nullptr || it->second < first_index) {
      first = &record;
      first_index = it->second;
    }
  }
  return first;
}

std::string RoutingReplaySource::missing(const std::span<const int32_t> tokens_BS, const int64_t B,
                                         const int64_t first_sample) const {
  for (int64_t b = 0; b < B; ++b) {
    if (find(tokens_BS.subspan(static_cast<size_t>(b * S_), static_cast<size_t>(S_))) == nullptr) {
      return "routing recording " + path_ + " has no record of training sample " + std::to_string(first_sample + b) +
             " (no record starts with its " + std::to_string(S_) + " tokens)";
    }
  }
  return "";
}

RoutingReplayBatch RoutingReplaySource::batch(const std::span<const int32_t> tokens_BS, const int64_t B,
                                              const int64_t first_sample) const {
  if (const std::string problem = missing(tokens_BS, B, first_sample); !problem.empty()) throw ConfigError(problem);
  RoutingReplayBatch out;
  out.S = S_;
  out.B = B;
  out.routers = recording_.num_routers();
  out.topk = recording_.topk;
  out.experts.resize(static_cast<size_t>(S_ * B * out.routers * out.topk));
  const int64_t per_token = out.routers * out.topk;
  for (int64_t b = 0; b < B; ++b) {
    const RoutingRecord& record = *find(tokens_BS.subspan(static_cast<size_t>(b * S_), static_cast<size_t>(S_)));
    for (int64_t s = 0; s < S_; ++s) {
      const int32_t* from = record.experts.data() + s * per_token;
      std::copy(from, from + per_token, out.experts.begin() + (s * B + b) * per_token);
    }
  }
  return out;
}

RoutingRecorder::RoutingRecorder(const ModelConfig& config)
    : topk_(config.moe.topk), num_experts_(config.moe.num_experts), router_layers_(moe_router_layers(config)) {
  experts_.resize(router_layers_.size());
}

void RoutingRecorder::record(const int64_t router, const Tensor& selected_TK) {
  if (router < 0 || router >= static_cast<int64_t>(experts_.size()) || selected_TK.dtype() != DType::kI32 ||
      selected_TK.ndim() != 2 || selected_TK.dim(1) != topk_) {
    throw std::invalid_argument("routing recorder: a selection of router " + std::to_string(router) +
                                " that is not kI32 [T, topk]");
  }
  std::vector<int32_t>& experts = experts_[static_cast<size_t>(router)];
  const int64_t recorded = static_cast<int64_t>(experts.size()) / topk_;
  if (first_position_ > recorded) {
    throw std::logic_error("routing recorder: position " + std::to_string(first_position_) + " follows only " +
                           std::to_string(recorded) + " recorded positions");
  }
  const int64_t T = selected_TK.dim(0), skip = std::min(T, recorded - first_position_);
  const int32_t* ids = selected_TK.data<int32_t>();
  experts.insert(experts.end(), ids + skip * topk_, ids + T * topk_);
}

RoutingRecord RoutingRecorder::finish(std::vector<int32_t> tokens) const {
  int64_t routed = static_cast<int64_t>(tokens.size());
  for (const std::vector<int32_t>& experts : experts_)
    routed = std::min(routed, static_cast<int64_t>(experts.size()) / topk_);
  RoutingRecord record;
  record.tokens = std::move(tokens);
  record.routed = routed;
  const auto R = static_cast<int64_t>(experts_.size());
  record.experts.resize(static_cast<size_t>(routed * R * topk_));
  for (int64_t t = 0; t < routed; ++t) {
    for (int64_t r = 0; r < R; ++r) {
      const int32_t* from = experts_[static_cast<size_t>(r)].data() + t * topk_;
      std::copy(from, from + topk_, record.experts.begin() + (t * R + r) * topk_);
    }
  }
  return record;
}

RoutingRecording RoutingRecorder::empty_recording() const {
  RoutingRecording recording;
  recording.topk = topk_;
  recording.num_experts = num_experts_;
  recording.router_layers = router_layers_;
  return recording;
}

void append_routing_record(const std::string& path, const RoutingRecording& empty, RoutingRecord record) {
  std::error_code error;
  RoutingRecording recording = std::filesystem::exists(path, error) ? read_routing_recording(path) : empty;
  if (recording.router_layers != empty.router_layers || recording.topk != empty.topk ||
      recording.num_experts != empty.num_experts) {
    throw ConfigError("routing recording " + path + ": recorded for MoE layers " + list_text(recording.router_layers) +
                      " with top-" + std::to_string(recording.topk) + " over " + std::to_string(recording.num_experts) +
                      " experts, this model has " + list_text(empty.router_layers) + " with top-" +
                      std::to_string(empty.topk) + " over " + std::to_string(empty.num_experts));
  }
  recording.records.push_back(std::move(record));
  write_routing_recording(path, recording);
}

}  // namespace moecore
