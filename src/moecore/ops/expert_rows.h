// The MoE dispatchers' permute index step on tensors (semantics: kernels/cpu/expert_rows.h; Megatron's
// moe_utils.permute: routing_map.T.nonzero(), probs.T.masked_select(routing_map.T)).
#pragma once

#include <cstdint>
#include <span>

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// The rows of experts [e_begin, e_begin + X) of a [T, E] routing map (map_TE kU8) in expert-major order: expert
// e_begin + x owns rows_X[x] rows, its routed tokens ascending, then padding rows (token -1, probability 0).
// token_R (kI64) and probs_R (probs_TE's dtype, fp32 or fp64) hold R = sum rows_X elements (overwritten).
// Each expert's routed count must equal rows_X[x], or (pad-to-capacity, capacity >= 0) rows_X[x] must be the
// capacity with at most that many routed; else std::invalid_argument naming the expert.
void expert_major_rows(Tensor& token_R, Tensor& probs_R, const Tensor& map_TE, const Tensor& probs_TE, int64_t e_begin,
                       std::span<const int64_t> rows_X, int64_t capacity);

}  // namespace moecore::ops
