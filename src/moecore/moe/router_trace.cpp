#include "moecore/moe/router_trace.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <system_error>

#include "moecore/ops/convert.h"
#include "moecore/util/torch_save.h"

namespace moecore {

namespace {

std::ofstream open_empty(const std::string& path, const std::ios::openmode mode) {
  std::ofstream file(path, mode | std::ios::trunc);
  if (!file) throw std::runtime_error("routing trace: cannot write " + path + ": " + std::strerror(errno));
  return file;
}

void check_written(const std::ofstream& file, const std::string& path) {
  if (!file) throw std::runtime_error("routing trace: writing " + path + " failed: " + std::strerror(errno));
}

void append_shape(std::string& line, const char* name, const int64_t rows, const int64_t columns) {
  line += ", \"";
  line += name;
  line += "\": [" + std::to_string(rows) + ", " + std::to_string(columns) + "]";
}

void append_field(std::string& line, const char* name, const int64_t value) {
  line += ", \"";
  line += name;
  line += "\": " + std::to_string(value);
}

}  // namespace

RouterTracer::RouterTracer(RouterTraceOptions options) : options_(std::move(options)) {
  std::error_code error;
  std::filesystem::create_directories(options_.dir, error);
  if (error) throw std::runtime_error("routing trace: cannot create " + options_.dir + ": " + error.message());
  const std::string rank = std::to_string(options_.rank);
  jsonl_path_ = (std::filesystem::path(options_.dir) / ("router_trace_rank" + rank + ".jsonl")).string();
  hidden_path_ = (std::filesystem::path(options_.dir) / ("hidden_states_rank" + rank + ".bin")).string();
  logits_path_ = (std::filesystem::path(options_.dir) / ("logits_rank" + rank + ".bin")).string();
  jsonl_ = open_empty(jsonl_path_, std::ios::out);
  if (options_.capture_hidden_states) hidden_ = open_empty(hidden_path_, std::ios::out | std::ios::binary);
  if (options_.capture_logits) logits_ = open_empty(logits_path_, std::ios::out | std::ios::binary);
}

RouterTracer::~RouterTracer() = default;

int64_t RouterTracer::append_bf16(std::ofstream& file, const std::string& path, const Tensor& x, int64_t& offset) {
  Tensor bits = Tensor::uninitialized(x.shape(), DType::kBF16);
  ops::convert(bits, x);
  const auto bytes = static_cast<std::streamsize>(bits.nbytes());
  file.write(bits.data<char>(), bytes);
  check_written(file, path);
  const int64_t at = offset;
  offset += bytes;
  return at;
}

void RouterTracer::record(const RouterTraceSite& site, const Tensor& routing_map_TE, const int64_t topk,
                          const Tensor& hidden_TH, const Tensor& logits_TE, const RouterTraceWeights& weights) {
  if (!active()) return;
  if (options_.dump_router_weights) {  // Megatron keeps each router's state at its first traced forward
    const bool seen = std::any_of(router_states_.begin(), router_states_.end(), [&](const RouterState& state) {
      return state.site.mtp == site.mtp && state.site.layer == site.layer && state.site.mtp_idx == site.mtp_idx;
    });
    if (!seen) {
      Tensor weight = Tensor::uninitialized(weights.weight_EH.shape(), DType::kF32);
      ops::convert(weight, weights.weight_EH);
      router_states_.push_back({site, weights.weight_EH.shape(),
                                std::vector<float>(weight.span<float>().begin(), weight.span<float>().end()),
                                std::vector<float>(weights.expert_bias_E.begin(), weights.expert_bias_E.end()),
                                weights.score_function, topk});
    }
  }
  const int64_t T = routing_map_TE.dim(0), E = routing_map_TE.dim(1);
  Record record;
  record.site = site;
  record.num_tokens = T;
  record.topk = topk;
  record.top_indices.reserve(static_cast<size_t>(T * topk));
  const uint8_t* map = routing_map_TE.data<uint8_t>();
  for (int64_t t = 0; t < T; ++t) {
    int64_t chosen = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (map[t * E + e] == 0) continue;
      record.top_indices.push_back(static_cast<int32_t>(e));
      ++chosen;
    }
    if (chosen != topk) {  // Megatron's hook returns when the map's nonzeros are not num_tokens * topk
      ++records_left_out_;
      return;
    }
  }
  if (options_.capture_hidden_states && hidden_TH.defined() && hidden_TH.dim(0) == T) {
    record.hs_offset = append_bf16(hidden_, hidden_path_, hidden_TH, hidden_offset_);
    record.hs_bytes = hidden_offset_ - *record.hs_offset;
    record.hidden = hidden_TH.dim(1);
  }
  if (options_.capture_logits && logits_TE.defined() && logits_TE.dim(0) == T) {
    record.logit_offset = append_bf16(logits_, logits_path_, logits_TE, logits_offset_);
    record.logit_bytes = logits_offset_ - *record.logit_offset;
    record.experts = logits_TE.dim(1);
  }
  pending_.push_back(std::move(record));
}

void RouterTracer::write(const Record& record, const int64_t step) {
  // Python's json.dumps separators (", ", ": ") and the key order of Megatron's records.
  std::string line = "{\"step\": " + std::to_string(step) + ", \"stage\": \"pre_dispatch\", \"block\": \"" +
                     (record.site.mtp ? "mtp" : "decoder") + "\"";
  append_field(line, "layer", record.site.layer);
  append_field(line, "rank", options_.rank);
  append_field(line, "num_tokens", record.num_tokens);
  append_field(line, "topk", record.topk);
  if (record.site.mtp_idx) append_field(line, "mtp_idx", *record.site.mtp_idx);
  if (record.hs_offset) {
    append_field(line, "hs_offset", *record.hs_offset);
    append_field(line, "hs_bytes", *record.hs_bytes);
    append_shape(line, "hs_shape", record.num_tokens, *record.hidden);
  }
  if (record.logit_offset) {
    append_field(line, "logit_offset", *record.logit_offset);
    append_field(line, "logit_bytes", *record.logit_bytes);
    append_shape(line, "logit_shape", record.num_tokens, *record.experts);
  }
  line += ", \"top_indices\": [";
  for (int64_t t = 0; t < record.num_tokens; ++t) {
    line += t == 0 ? "[" : ", [";
    for (int64_t k = 0; k < record.topk; ++k) {
      if (k > 0) line += ", ";
      line += std::to_string(record.top_indices[static_cast<size_t>(t * record.topk + k)]);
    }
    line += "]";
  }
  line += "]}\n";
  jsonl_ << line;
}

void RouterTracer::advance_step(const int64_t step) {
  if (!active()) return;
  for (const Record& record : pending_) write(record, step);
  records_written_ += static_cast<int64_t>(pending_.size());
  pending_.clear();
  jsonl_.flush();
  check_written(jsonl_, jsonl_path_);
  if (hidden_.is_open()) {
    hidden_.flush();
    check_written(hidden_, hidden_path_);
  }
  if (logits_.is_open()) {
    logits_.flush();
    check_written(logits_, logits_path_);
  }
  ++steps_written_;
}

void RouterTracer::finish() {
  if (!options_.dump_router_weights) return;
  std::vector<std::pair<PyValue, PyValue>> states;
  for (const RouterState& state : router_states_) {
    PyValue key = PyValue::tuple({PyValue::string(state.site.mtp ? "mtp" : "decoder"),
                                  state.site.mtp_idx ? PyValue::integer(*state.site.mtp_idx) : PyValue::none(),
                                  PyValue::integer(state.site.layer)});
    const auto E = static_cast<int64_t>(state.expert_bias.size());
    states.emplace_back(
        std::move(key),
        PyValue::dict({{PyValue::string("weight"), PyValue::float_tensor(state.weight_shape, state.weight)},
                       {PyValue::string("expert_bias"),
                        state.expert_bias.empty() ? PyValue::none() : PyValue::float_tensor({E}, state.expert_bias)},
                       {PyValue::string("score_function"), PyValue::string(state.score_function)},
                       {PyValue::string("topk"), PyValue::integer(state.topk)}}));
  }
  const std::string path =
      (std::filesystem::path(options_.dir) / ("router_state_rank" + std::to_string(options_.rank) + ".pt")).string();
  write_torch_save(path, PyValue::dict(std::move(states)));
}

}  // namespace moecore
