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

// Fills `param.value` from the counter RNG keyed by (seed, name, element index): N(0, std) for kNormal,
// N(0, std / sqrt(2 * num_layers)) for kScaledNormal (Megatron's output-layer init for linear_proj / fc2).
void init_param(Param& param, uint64_t seed, double std, int64_t num_layers);

}  // namespace moecore
