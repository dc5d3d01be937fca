// Megatron's activation recomputation settings (megatron/core/transformer/transformer_config.py:
// recompute_granularity, recompute_method, recompute_num_layers, recompute_modules, distribute_saved_activations),
// and which layers and modules they recompute (transformer_block.py _checkpointed_forward, transformer_layer.py).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moecore {

struct RecomputeConfig {
  enum class Granularity { kNone, kFull, kSelective };
  enum class Method { kNone, kUniform, kBlock };
  Granularity granularity = Granularity::kNone;
  Method method = Method::kNone;
  int64_t num_layers = 0;            // --recompute-num-layers (full)
  std::vector<std::string> modules;  // --recompute-modules (selective; Megatron's default core_attn)
  // --distribute-saved-activations (full, TP > 1 without sequence parallelism): each TP rank keeps its 1/TP of a
  // checkpoint's input rows and the recompute all-gathers them.
  bool distribute_saved_activations = false;

  bool full() const { return granularity == Granularity::kFull; }
  // Selective recomputation of `module` (core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts).
  bool has(std::string_view module) const;
  // Full recomputation of a model chunk of `chunk_layers` layers: whether its layer `index` (0-based in the chunk)
  // is checkpointed, and the first layer of the checkpoint it belongs to (uniform: groups of num_layers, the last
  // maybe shorter; block: the first num_layers layers one at a time).
  bool checkpointed(int64_t index) const;
  int64_t checkpoint_begin(int64_t index) const;
  int64_t checkpoint_end(int64_t index, int64_t chunk_layers) const;  // one past its last layer
};

// Megatron's recompute_modules choices that moecore's layers have.
const std::vector<std::string>& recompute_module_names();

}  // namespace moecore
