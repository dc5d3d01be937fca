// Megatron's pad_routing_map on tensors (semantics: kernels/cpu/routing_padding.h, --moe-router-padding-for-
// quantization): map_TE kU8 [T, E] padded in place, counts_E kI64 [E] overwritten with the padded column sums.
#pragma once

#include <cstdint>

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

void pad_routing_map(Tensor& map_TE, Tensor& counts_E, int64_t multiple);

}  // namespace moecore::ops
