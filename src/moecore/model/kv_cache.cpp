#include "moecore/model/kv_cache.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "moecore/model/gpt_model.h"
#include "moecore/ops/rows.h"

namespace moecore {
namespace {

Tensor cache_tensor(const int64_t rows, const int64_t width) {
  return Tensor(std::vector<int64_t>{rows, width}, DType::kF32, MemCategory::kActivations);
}

void write_rows(Tensor& cache_SX, const std::span<const int64_t> positions, const Tensor& new_TX) {
  const int64_t width = cache_SX.dim(1), rows = cache_SX.dim(0);
  if (new_TX.dtype() != DType::kF32 || new_TX.numel() != static_cast<int64_t>(positions.size()) * width) {
    throw std::logic_error("KvCache: " + new_TX.shape_str() + " is not one row of " + std::to_string(width) +
                           " values per new position");
  }
  for (const int64_t position : positions) {
    if (position < 0 || position >= rows) {
      throw std::logic_error("KvCache: position " + std::to_string(position) + " is outside the cache of " +
                             std::to_string(rows) + " positions");
    }
  }
  const auto n = static_cast<int64_t>(positions.size());
  const Tensor new_rows = new_TX.view({n, width});
  for (int64_t i = 0; i < n;) {  // runs of consecutive positions, one copy each
    int64_t end = i + 1;
    while (end < n && positions[end] == positions[end - 1] + 1) ++end;
    Tensor dst = cache_SX.slice_rows(positions[i], positions[i] + (end - i));
    ops::copy_columns(dst, width, 0, new_rows.slice_rows(i, end), width, 0, width);
    i = end;
  }
}

}  // namespace

void LayerKvCache::write(const std::span<const int64_t> positions, const Tensor& new_first_TX,
                         const Tensor& new_second_TY) {
  write_rows(first_SX, positions, new_first_TX);
  write_rows(second_SY, positions, new_second_TY);
}

KvCache::KvCache(const ModelConfig& config, const int64_t capacity) : capacity_(capacity) {
  if (capacity <= 0) throw std::invalid_argument("KvCache: the capacity must be positive");
  int64_t first_width = 0, second_width = 0;
  if (config.mla) {
    first_width = config.mla->kv_lora_rank;
    second_width = config.mla->qk_pos_emb_head_dim;
  } else {
    first_width = second_width = config.num_query_groups * config.kv_channels;
  }
  layers_.resize(static_cast<size_t>(config.num_layers));
  for (LayerKvCache& layer : layers_) {
    layer.first_SX = cache_tensor(capacity, first_width);
    layer.second_SY = cache_tensor(capacity, second_width);
  }
}

void KvCache::advance(const int64_t count) {
  if (count < 0 || length_ + count > capacity_) {
    throw std::logic_error("KvCache: " + std::to_string(length_) + " + " + std::to_string(count) +
                           " positions outgrow the capacity of " + std::to_string(capacity_));
  }
  length_ += count;
}

int64_t attended_positions(const std::span<const int64_t> positions) {
  if (positions.empty()) throw std::logic_error("a decode step needs at least one new token");
  return *std::max_element(positions.begin(), positions.end()) + 1;
}

std::string kv_cache_unsupported_reason(const GPTModel& model) {
  const parallel::ParallelState& parallel = model.parallel();
  if (parallel.tp_size() > 1 || parallel.cp_size() > 1 || model.num_chunks() != 1 || !model.stage().pre_process ||
      !model.stage().post_process) {
    return "the model is split over processes";
  }
  const ModelConfig& config = model.config();
  if (config.moe.enabled() && config.moe.capacity_factor) {
    return "--moe-expert-capacity-factor drops tokens by the forward's token count";
  }
  if (config.quantization) return "quantized linear layers scale over the forward's whole input";
  if (config.params_dtype != DType::kF32) return "16-bit activations round the decode's last-bit differences";
  return "";
}

}  // namespace moecore
