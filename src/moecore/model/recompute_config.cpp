#include "moecore/model/recompute_config.h"

#include <algorithm>

namespace moecore {

bool RecomputeConfig::has(const std::string_view module) const {
  return granularity == Granularity::kSelective && std::find(modules.begin(), modules.end(), module) != modules.end();
}

bool RecomputeConfig::checkpointed(const int64_t index) const {
  if (!full()) return false;
  return method == Method::kUniform || index < num_layers;
}

int64_t RecomputeConfig::checkpoint_begin(const int64_t index) const {
  return method == Method::kUniform ? index - index % num_layers : index;
}

int64_t RecomputeConfig::checkpoint_end(const int64_t index, const int64_t chunk_layers) const {
  return method == Method::kUniform ? std::min(checkpoint_begin(index) + num_layers, chunk_layers) : index + 1;
}

const std::vector<std::string>& recompute_module_names() {
  static const std::vector<std::string> names = {"core_attn", "moe_act", "layernorm",     "mla_up_proj",
                                                 "mlp",       "moe",     "shared_experts"};
  return names;
}

}  // namespace moecore
