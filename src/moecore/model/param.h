// A trainable parameter: fp32 value and gradient under a Megatron-style name
// (e.g. "decoder.layers.0.self_attention.linear_qkv.weight").
#pragma once

#include <string>
#include <vector>

#include "moecore/tensor/tensor.h"

namespace moecore {

enum class InitKind { kNormal, kScaledNormal, kZeros, kOnes };

struct Param {
  std::string name;
  Tensor value;  // fp32, MemCategory::kParams
  Tensor grad;   // fp32, MemCategory::kGrads, same shape; backward accumulates into it
  InitKind init = InitKind::kNormal;
  bool no_weight_decay = false;  // biases and norm weights, as Megatron
};

// A zero-filled fp32 parameter and its gradient, tracked as kParams / kGrads. 1-D parameters (biases, norm
// weights) get no weight decay, as Megatron's default parameter groups.
Param make_param(std::string name, const std::vector<int64_t>& shape, InitKind init);

// The parameters named `names`, in that order; throws std::logic_error naming one that is missing.
std::vector<Param*> find_params(std::vector<Param>& params, const std::vector<std::string>& names);
Param* find_param(std::vector<Param>& params, const std::string& name);

// Fills `param.value` from the counter RNG keyed by (seed, name, element index): N(0, std) for kNormal,
// N(0, std / sqrt(2 * num_layers)) for kScaledNormal (Megatron's output-layer init for linear_proj / fc2).
void init_param(Param& param, uint64_t seed, double std, int64_t num_layers);

}  // namespace moecore
