// Parameter initialization draws on tensors (semantics: kernels/cpu/normal_fill.h).
#pragma once

#include <cstdint>
#include <span>

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// out = sigma * N(0, 1) from CounterRng(seed, key) at element indices given as runs: out's elements are
// first_R.size() runs of `run` consecutive indices, run r starting at first_R[r] (overwrites; out.numel() must be
// first_R.size() * run).
void normal_fill(Tensor& out, std::span<const int64_t> first_R, int64_t run, uint64_t seed, uint64_t key, double sigma);

}  // namespace moecore::ops
